"""CPU copies that take the bucket checksum on the way: one pass over memory, not two.

The CPU twin of :mod:`.summed_copies`. The copies are cut into pieces of at most
:data:`BLOCK_BYTES` of the bucket and run in the bucket's byte order, a few pieces at a time
(a step); right after a step's copies, the checksum rows they finished are summed
(:func:`~.checksum.row_sums`'s 64 KiB and 256-byte rows), and on a pack each piece is compared
with its source (:func:`~.checksum.verify_copies`), while the bytes are still in cache: memory
is read and written once, and the sum and the check read the cache. The rows are those of
:func:`~.checksum.row_sums` and are weighted the same way, so the value is the same on every
path. A row is summed once no piece that is still to come starts before its end, so pieces
that interleave in the bucket (a TP shard's columns beside the others') are summed once both
are copied. Rows no copy touches (padding, tensors a rank does not keep) are summed as they
are (the sender zeroes the padding first: :attr:`~.buckets.Bucket.gaps`).

A block runs on the calling thread alone (libc's memmove and memcmp for contiguous copies,
numpy's row sums), not as torch ops: the sender and a receiver work at once on few cores, and
a small parallel op per block waits for whichever of its threads was descheduled.

:meth:`BlockedCopies.plan` gives up (None) where a copy's bucket side lies outside the bucket;
the caller then copies and sums apart, as before.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from weightsync.buckets import ALIGNMENT_BYTES, Bucket, byte_view
from weightsync.checksum import ROW_WORDS, verify_copies, whole_row_words
from weightsync.memo import Memo, Same
from weightsync.regions import CopyBatch, Pair

BLOCK_BYTES = 2 << 20
"""A step's share of the bucket: small enough that its bytes are still in cache when summed
and checked, large enough that the Python per step is small beside the copies."""
_ROW_BYTES = ROW_WORDS * 8


@dataclass(frozen=True)
class Piece:
    dst: torch.Tensor
    src: torch.Tensor
    at: int
    """The first byte of its bucket side, from the bucket's start."""
    owner: int
    """The index of the pair it was cut from."""


@dataclass(frozen=True)
class Step:
    pieces: tuple[Piece, ...]
    alike: tuple[Piece, ...]
    """The pieces copied as bytes (contiguous, one dtype), in the order of :attr:`moves`."""
    moves: tuple[tuple[int, int, int], ...]
    """(destination, source, bytes) of each of :attr:`alike`."""
    unlike: tuple[Piece, ...]
    others: CopyBatch | None
    """The other pieces (strided, cast)."""
    sums: tuple[tuple[np.ndarray, np.ndarray], ...]
    """(rows of words, their sums' slots) summed after the copies: whole checksum rows."""


_libc = ctypes.CDLL(None)
_libc.memcmp.restype = ctypes.c_int
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_libc.memmove.restype = ctypes.c_void_p
_libc.memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def _bytes_alike(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous()


def _extent(t: torch.Tensor) -> int:
    """Bytes from a view's first element to one past its last (non-negative strides)."""
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * (
        t.element_size()
    )


def split(dst: torch.Tensor, src: torch.Tensor, block: int = BLOCK_BYTES) -> list[Pair]:
    """``(dst, src)`` cut into copies of at most about ``block`` bytes of ``dst``: contiguous
    pairs by elements, others by leading-dim rows (a row wider than ``block`` stays whole)."""
    if dst.dim() == 0 or dst.shape != src.shape or dst.nbytes <= block:
        return [(dst, src)]
    if dst.is_contiguous() and src.is_contiguous():
        d, s = dst.reshape(-1), src.reshape(-1)
        step = max(1, block // dst.element_size())
        return [(d[i : i + step], s[i : i + step]) for i in range(0, d.numel(), step)]
    row = dst.stride(0) * dst.element_size()
    rows = max(1, block // row) if row > 0 else dst.shape[0]
    n = dst.shape[0]
    return [(dst[i : i + rows], src[i : i + rows]) for i in range(0, n, rows)]


def _row_floor(byte: int, whole_bytes: int) -> int:
    """The last checksum row boundary at or before ``byte``."""
    if byte <= whole_bytes:
        return byte // _ROW_BYTES * _ROW_BYTES
    return whole_bytes + (byte - whole_bytes) // ALIGNMENT_BYTES * ALIGNMENT_BYTES


def plan_steps(
    pairs: Sequence[Pair], base: int, nbytes: int, *, destination: bool, block: int = BLOCK_BYTES
) -> list[tuple[list[Piece], int, int]] | None:
    """The steps (pieces, summed ``[start, stop)``) that copy ``pairs`` and sum every row of
    the bucket at address ``base`` (``nbytes``, a multiple of the alignment) exactly once, in
    byte order; the bucket is the copies' destination when ``destination``, else their
    source. None when a copy's bucket side is not inside the bucket."""
    pieces = []
    for owner, (dst, src) in enumerate(pairs):
        if dst.numel() == 0:
            continue
        for d, s in split(dst, src, block):
            side = d if destination else s
            at = side.data_ptr() - base
            if at < 0 or at + _extent(side) > nbytes or min(side.stride(), default=0) < 0:
                return None
            pieces.append(Piece(d, s, at, owner))
    pieces.sort(key=lambda p: p.at)
    whole_bytes = whole_row_words(nbytes) * 8
    steps: list[tuple[list[Piece], int, int]] = []
    current: list[Piece] = []
    summed = 0
    for i, piece in enumerate(pieces):
        current.append(piece)
        # Every piece still to come starts at or after the next one: rows before it are final.
        upto = nbytes if i + 1 == len(pieces) else _row_floor(pieces[i + 1].at, whole_bytes)
        if upto == nbytes or upto - summed >= block:
            steps.append((current, summed, upto))
            current, summed = [], upto
    if summed < nbytes or not steps:
        steps.append((current, summed, nbytes))
    return steps


class BlockedCopies:
    """``pairs`` copied step by step (:func:`plan_steps`), each step's rows of
    ``buffer[:nbytes]`` summed right after its copies (``sums``); build once (:meth:`plan`)
    and :meth:`run` every version."""

    def __init__(
        self,
        steps: list[tuple[list[Piece], int, int]],
        buffer: torch.Tensor,
        nbytes: int,
        names: Sequence[str] = (),
        sums: bool = True,
    ) -> None:
        self.buffer, self.nbytes, self.names, self.sums = buffer, nbytes, tuple(names), sums
        self._whole = whole_row_words(nbytes) * 8
        rows = self._whole // _ROW_BYTES + (nbytes - self._whole) // ALIGNMENT_BYTES
        self._rows = torch.zeros(rows, dtype=torch.int64)
        self._positions = torch.arange(1, rows + 1, dtype=torch.int64)
        words = buffer[:nbytes].view(torch.int64).numpy() if nbytes else None
        self.steps = [self._step(p, a, b, words) for p, a, b in steps]

    def _step(self, pieces: list[Piece], start: int, stop: int, words) -> Step:
        alike = tuple(p for p in pieces if _bytes_alike(p.dst, p.src))
        unlike = tuple(p for p in pieces if not _bytes_alike(p.dst, p.src))
        moves = tuple((p.dst.data_ptr(), p.src.data_ptr(), p.dst.nbytes) for p in alike)
        others = [(p.dst, p.src) for p in unlike]
        sums = []
        if self.sums and start < stop:
            whole, rows = self._whole, self._rows.numpy()
            tail, first = ALIGNMENT_BYTES // 8, whole // _ROW_BYTES
            if start < min(stop, whole):
                end = min(stop, whole)
                sums.append((words[start // 8 : end // 8].reshape(-1, ROW_WORDS),
                             rows[start // _ROW_BYTES : end // _ROW_BYTES]))  # fmt: skip
            if stop > max(start, whole):
                begin = max(start, whole)
                sums.append((words[begin // 8 : stop // 8].reshape(-1, tail),
                             rows[first + (begin - whole) // ALIGNMENT_BYTES :
                                  first + (stop - whole) // ALIGNMENT_BYTES]))  # fmt: skip
        batch = CopyBatch.of(others) if others else None
        return Step(tuple(pieces), alike, moves, unlike, batch, tuple(sums))

    @classmethod
    def plan(
        cls,
        pairs: Sequence[Pair],
        buffer: torch.Tensor,
        nbytes: int,
        *,
        destination: bool,
        names: Sequence[str] = (),
        sums: bool = True,
        block: int = BLOCK_BYTES,
    ) -> BlockedCopies | None:
        """The blocked copies of ``pairs`` over CPU ``buffer``, or None where they cannot be
        (a CUDA tensor, a copy outside the bucket). ``names``: the tensor of each pair, for a
        pack that checks its copies (:meth:`run`); ``sums=False``: copy and check only;
        ``block``: the bytes of a step (tests cut small buckets into many)."""
        if buffer.is_cuda or nbytes % ALIGNMENT_BYTES or nbytes > buffer.numel():
            return None
        if any(d.is_cuda or s.is_cuda for d, s in pairs):
            return None
        steps = plan_steps(pairs, buffer.data_ptr(), nbytes, destination=destination, block=block)
        return None if steps is None else cls(steps, buffer, nbytes, names, sums)

    @torch.no_grad()
    def run(self, check: str | None = None) -> torch.Tensor | None:
        """Make the copies; with ``check`` (what the pack is, for the error) compare each
        piece with its source right after its step. Returns the checksum's reduction (as
        :func:`~.checksum.row_sums`), or None when built with ``sums=False``.

        Raises:
            ChecksumError: a piece differs from its source (names ``check`` and the tensor).
        """
        for step in self.steps:
            self._copy(step)
            if check is not None:
                # The addresses worked out once: a tensor's attributes cost more than the
                # memcmp of a small piece, and a pack has a piece per tensor.
                for (dst, src, n), p in zip(step.moves, step.alike, strict=True):
                    if _libc.memcmp(dst, src, n):
                        verify_copies(check, self.names[p.owner], [(p.dst, p.src)])
                for p in step.unlike:
                    verify_copies(check, self.names[p.owner], [(p.dst, p.src)])
            for words, out in step.sums:
                np.sum(words, axis=1, out=out)
        if not self.sums:
            return None
        if not self.nbytes:
            return torch.zeros(2, dtype=torch.int64)
        rows = self._rows
        return torch.stack([(rows * self._positions).sum(), rows.sum()])

    @staticmethod
    def _copy(step: Step) -> None:
        for dst, src, n in step.moves:
            _libc.memmove(dst, src, n)
        if step.others is not None:
            step.others.run()


class CheckedPacks:
    """A CPU publisher's packs: each bucket copied from whole tensors into its CPU buffer as
    ``pack_entry`` does, each block compared with its source right after its copy, still in
    cache (``verify_entry``'s check without its second read). The copies are planned once per
    (bucket, buffer, tensors), by identity: a publisher passes the same mapping object while
    its tensors stay where they were, and planning the blocks was most of a pack of hundreds
    of small tensors, on every version's path."""

    def __init__(self, max_entries: int = 256) -> None:
        self._plans: Memo[Same, BlockedCopies | None] = Memo(max_entries)

    def __call__(
        self, what: str, bucket: Bucket, buffer: torch.Tensor, tensors: Mapping[str, torch.Tensor]
    ) -> bool:
        """Pack ``bucket``; False, having written nothing, where these copies do not apply (a
        CUDA buffer, a tensor not contiguous or not as the manifest says): pack and verify as
        before.

        Raises:
            ChecksumError: a block differs from its source (names ``what`` and the tensor).
        """
        key = Same(bucket, buffer, tensors)
        copies = self._plans.get(key, lambda: checked_pack(bucket, buffer, tensors))
        if copies is None:
            return False
        copies.run(check=what)
        return True


def checked_pack(
    bucket: Bucket, buffer: torch.Tensor, tensors: Mapping[str, torch.Tensor]
) -> BlockedCopies | None:
    """The copies :class:`CheckedPacks` makes (they check against ``tensors`` when run), or
    None where they do not apply."""
    pairs, names = [], []
    for entry in bucket.entries:
        spec, tensor = entry.spec, tensors[entry.name]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.torch_dtype:
            return None
        if entry.nbytes == 0:
            continue
        if not tensor.is_contiguous():
            return None
        src = byte_view(tensor)[entry.tensor_offset : entry.tensor_offset + entry.nbytes]
        pairs.append((buffer[entry.offset : entry.offset + entry.nbytes], src))
        names.append(entry.name)
    return BlockedCopies.plan(
        pairs, buffer, bucket.nbytes, destination=True, names=names, sums=False
    )
