"""Copies that take a bucket's checksum on the way, so its bytes are read once, not twice.

The checksum (:mod:`.checksum`) is a sum of the bucket's 8-byte words, each weighted by its
row's position: linear in the words, so any split of the bucket into spans can be summed span
by span. Here the spans are the copies themselves: the sender's pack copies (the bucket is
their destination) or a receiver's reads into its parameters (the bucket is their source),
and sum-only spans over whatever no copy moves (alignment padding, tensors this rank does not
keep). Every word is summed exactly once, in the same launch as the copies
(:mod:`.copy_kernel`'s ``copy_sum``).

:func:`plan_rows` is the pure part (addresses in, table rows out), tested on CPU; it gives up
(None) where the rule cannot hold cheaply, and the caller copies and sums apart as before:
strided or cross-device copies, casts, ends not 8-byte aligned, spans that overlap unless
identical source spans (a receiver reading one tensor into two parameters).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync import copy_kernel
from weightsync.checksum import whole_row_words
from weightsync.regions import CopyBatch, Pair

SUM_DESTINATION = 1
"""Row flag: the summed side is the destination (else the source)."""
NO_SUM = 2
"""Row flag: copy only (another row already sums these source bytes)."""
_WORD = 8


@dataclass(frozen=True)
class Row:
    """One block's work: copy ``nbytes`` from ``src`` to ``dst`` (0: sum only), summing the
    summed side's words, the first of which is word ``word`` of the bucket."""

    src: int
    dst: int
    nbytes: int
    word: int
    flags: int


def _aligned(n: int) -> int:
    return -(-n // _WORD) * _WORD


def _chunked(src: int, dst: int, nbytes: int, at: int, flags: int) -> list[Row]:
    """A table row (a CUDA block) per :data:`~.copy_kernel.CHUNK_BYTES` of a span."""
    return [
        Row(
            src + o,
            dst + o if dst else 0,
            min(copy_kernel.CHUNK_BYTES, nbytes - o),
            (at + o) // _WORD,
            flags,
        )
        for o in range(0, nbytes, copy_kernel.CHUNK_BYTES)
    ]


def plan_rows(
    copies: Sequence[tuple[int, int, int]], *, base: int, nbytes: int, destination: bool
) -> list[Row] | None:
    """Rows that make ``copies`` (source address, destination address, bytes) and sum every
    word of the bucket at ``base`` (``nbytes``, a multiple of 8) exactly once; the bucket is
    the copies' destination when ``destination``, else their source. None when that cannot
    be planned: a copy outside the bucket or not 8-byte aligned, or two copies whose bucket
    spans overlap (unless both read the same source span)."""
    spans = []
    for src, dst, n in copies:
        if n == 0:
            continue
        at = (dst if destination else src) - base
        if at < 0 or at + n > nbytes or (at | src | dst) % _WORD:
            return None
        spans.append((at, n, src, dst))
    spans.sort()
    rows: list[Row] = []
    covered = 0
    last = None
    for at, n, src, dst in spans:
        if at < covered:
            # Only one write per destination byte, and a source span read twice is summed once.
            if destination or (at, n) != last:
                return None
            rows.extend(_chunked(src, dst, n, at, NO_SUM))
            continue
        rows.extend(_chunked(base + covered, 0, at - covered, covered, 0))
        rows.extend(_chunked(src, dst, n, at, SUM_DESTINATION if destination else 0))
        covered, last = _aligned(at + n), (at, n)
    rows.extend(_chunked(base + covered, 0, nbytes - covered, covered, 0))
    return rows


def table(rows: Sequence[Row]) -> torch.Tensor:
    """The kernel's table of ``rows`` (flat int64, five per row), on the CPU."""
    flat = [v for r in rows for v in (r.src, r.dst, r.nbytes, r.word, r.flags)]
    return torch.tensor(flat, dtype=torch.int64)


class SummedCopies:
    """``pairs`` copied by one launch that also takes the checksum of ``buffer[:nbytes]``;
    build once (:meth:`plan`) and :meth:`run` every version."""

    def __init__(self, pairs: Sequence[Pair], rows: list[Row], buffer: torch.Tensor, nbytes: int):
        self.pairs = tuple(pairs)  # the table holds their addresses: keep them alive
        self.buffer = buffer
        self.device = buffer.device
        self.blocks = len(rows)
        self.whole = whole_row_words(nbytes)
        self._table = table(rows).to(self.device)

    @classmethod
    def plan(
        cls, pairs: Sequence[Pair], buffer: torch.Tensor, nbytes: int, *, destination: bool
    ) -> SummedCopies | None:
        """The fused copies, or None where they cannot be (no CuPy or GPU, a copy that is
        not a contiguous same-GPU copy of the same dtype, or :func:`plan_rows` says no)."""
        pairs = [(d, s) for d, s in pairs if d.numel()]
        if not copy_kernel.available(buffer.device) or nbytes == 0:
            return None
        if not all(
            copy_kernel.fits(d, s)
            and d.is_contiguous()
            and s.is_contiguous()
            and d.device == buffer.device
            for d, s in pairs
        ):
            return None
        rows = plan_rows(
            [(s.data_ptr(), d.data_ptr(), d.nbytes) for d, s in pairs],
            base=buffer.data_ptr(),
            nbytes=nbytes,
            destination=destination,
        )
        return None if rows is None else cls(pairs, rows, buffer, nbytes)

    def run(self) -> torch.Tensor:
        """Queue the copies; returns the checksum's reduction (as :func:`~.checksum.row_sums`)."""
        out = torch.zeros(2, dtype=torch.int64, device=self.device)
        copy_kernel.launch(
            "copy_sum", self.device, self.blocks, self._table.data_ptr(), self.whole,
            out.data_ptr(),
        )  # fmt: skip
        return out


def copies(
    pairs: Sequence[Pair], buffer: torch.Tensor, nbytes: int, *, destination: bool
) -> SummedCopies | CopyBatch:
    """The copies of ``pairs`` to run every version: summing ``buffer[:nbytes]`` on the way
    where they can (``run()`` then returns the reduction), else a plain :class:`CopyBatch`
    (``run()`` returns None: sum apart)."""
    summed = SummedCopies.plan(pairs, buffer, nbytes, destination=destination)
    return summed or CopyBatch.of(pairs, reused=True)
