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
cross-device copies, casts, ends not 8-byte aligned, spans that overlap unless identical
source spans (a receiver reading one tensor into two parameters), and strided boxes that do
not fill whole rows of the bucket together (they do when every TP rank's columns of a tensor
are packed; an engine TP=2 rank reading its half of a bucket's tensor does not).

On CPU buffers :func:`copies` gives :mod:`.blocked_copies` instead: the same value, the sum
taken block by block behind the copies while the bytes are in cache.

A receiver reading a bucket on another GPU cannot sum on the way (:mod:`.peer_copies` moves
those bytes on the copy engines), and a second read of the bucket would prove the bucket, not
what landed: 4 x H200 once reported versions applied whose peer copies had read a bucket
before it was packed. :class:`LandedSums` sums each word where it landed instead, under its
bucket word, after the copies (:func:`landed_rows`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple, TypeVar

import torch

from weightsync import copy_kernel
from weightsync.blocked_copies import BlockedCopies
from weightsync.checksum import whole_row_words
from weightsync.regions import CopyBatch, Pair

SUM_DESTINATION = 1
"""Row flag: the summed side is the destination (else the source)."""
NO_SUM = 2
"""Row flag: copy only (another row already sums these source bytes)."""
_WORD = 8
D = TypeVar("D")


class Row(NamedTuple):
    """One block's work: copy ``nbytes`` from ``src`` to ``dst`` (0: sum only), summing the
    summed side's words, the first of which is word ``word`` of the bucket. With ``rows`` > 1
    a box: ``rows`` rows of ``nbytes``, each ``src_pitch`` / ``dst_pitch`` after the last.
    A tuple: a 512 MiB bucket is thousands of rows, built once per layout and buffer (as
    frozen dataclasses, :func:`plan_rows` of such a bucket took about twice as long)."""

    src: int
    dst: int
    nbytes: int
    word: int
    flags: int
    rows: int = 1
    src_pitch: int = 0
    dst_pitch: int = 0


Box = tuple[int, int, int, int, int, int]
"""(source, destination, bytes per row, rows, source pitch, destination pitch)."""
Copy = tuple[int, int, int] | Box
"""(source, destination, bytes), or a box."""


def _aligned(n: int) -> int:
    return -(-n // _WORD) * _WORD


def _chunked(box: Box, at: int, pitch: int, flags: int) -> list[Row]:
    """The table rows (CUDA blocks) of ``box`` (:func:`~.copy_kernel.chunks`), whose summed
    side starts at bucket byte ``at``, its rows ``pitch`` apart there."""
    src, dst, width, rows, sp, dp = box
    return [
        Row(src + r * sp + o, dst + r * dp + o if dst else 0, n, (at + r * pitch + o) // _WORD,
            flags, k, sp, dp)
        for r, o, n, k in copy_kernel.chunks(width, rows)
    ]  # fmt: skip


def _span(src: int, dst: int, nbytes: int, at: int, flags: int) -> list[Row]:
    """The table rows of a contiguous span (``dst`` 0: sum only)."""
    return _chunked((src, dst, nbytes, 1, 0, 0), at, 0, flags)


def _tiles(boxes: list[tuple[int, Box]], rows: int, pitch: int):
    """Boxes (bucket byte, box) of ``rows`` rows ``pitch`` apart in the bucket, as (bucket
    byte, bytes, boxes) spans: side by side they must fill whole rows (a TP shard's columns
    beside the others'), so each run of them is one contiguous span; None where they do not."""
    spans = []
    boxes.sort(key=lambda b: b[0])
    i = 0
    while i < len(boxes):
        at, width, run = boxes[i][0], 0, []
        while i < len(boxes) and boxes[i][0] == at + width and width < pitch:
            width += boxes[i][1][2]
            run.append(boxes[i])
            i += 1
        if width != pitch:
            return None
        spans.append((at, rows * pitch, run))
    return spans


def plan_rows(
    copies: Sequence[Copy], *, base: int, nbytes: int, destination: bool
) -> list[Row] | None:
    """Rows that make ``copies`` and sum every word of the bucket at ``base`` (``nbytes``, a
    multiple of 8) exactly once; the bucket is the copies' destination when ``destination``,
    else their source. None when that cannot be planned: a copy outside the bucket or not
    8-byte aligned, two copies whose bucket spans overlap (unless both read the same source
    span), or boxes that do not fill whole rows of the bucket together."""
    spans = []  # (bucket byte, bytes, source, destination, (pitch, boxes) or None)
    boxes: dict[tuple[int, int], list[tuple[int, Box]]] = {}
    for copy in copies:
        src, dst, n, rows, sp, dp = copy if len(copy) == 6 else (*copy, 1, 0, 0)
        if n == 0 or rows == 0:
            continue
        at = (dst if destination else src) - base
        if at < 0 or (at | src | dst) % _WORD:
            return None
        if rows == 1:
            if at + n > nbytes:
                return None
            spans.append((at, n, src, dst, None))
            continue
        pitch = dp if destination else sp
        if (n | sp | dp) % _WORD or n > pitch or at + (rows - 1) * pitch + n > nbytes:
            return None
        boxes.setdefault((rows, pitch), []).append((at, (src, dst, n, rows, sp, dp)))
    for (rows, pitch), group in boxes.items():
        tiles = _tiles(group, rows, pitch)
        if tiles is None:
            return None
        spans.extend((at, n, 0, 0, (pitch, run)) for at, n, run in tiles)
    spans.sort(key=lambda span: span[:2])
    out: list[Row] = []
    covered = 0
    last = None
    flags = SUM_DESTINATION if destination else 0
    for at, n, src, dst, tile in spans:
        if at < covered:
            # Only one write per destination byte, and a source span read twice is summed once.
            if destination or tile is not None or (at, n) != last:
                return None
            out.extend(_span(src, dst, n, at, NO_SUM))
            continue
        out.extend(_span(base + covered, 0, at - covered, covered, 0))
        if tile is None:
            out.extend(_span(src, dst, n, at, flags))
        else:
            pitch, run = tile
            for box_at, box in run:
                out.extend(_chunked(box, box_at, pitch, flags))
        covered, last = _aligned(at + n), (at, n)
    out.extend(_span(base + covered, 0, nbytes - covered, covered, 0))
    return out


def spans_of(pairs: Sequence[Pair]) -> list[Copy]:
    """``pairs`` (each :func:`~.copy_kernel.tabled`) as :func:`plan_rows`'s
    copies: spans, and boxes for strided ones (one per plane)."""
    out: list[Copy] = []
    for d, s in pairs:
        p = copy_kernel.planes(d, s)
        for so, do in p.offsets:
            span = (s.data_ptr() + so, d.data_ptr() + do, p.width)
            out.append(span if p.rows == 1 else (*span, p.rows, p.src_pitch, p.dst_pitch))
    return out


def table(rows: Sequence[Row]) -> torch.Tensor:
    """The kernel's table of ``rows`` (int64, a row of eight each), on the CPU."""
    flat = [
        v
        for r in rows
        for v in (r.src, r.dst, r.nbytes, r.rows, r.src_pitch, r.dst_pitch, r.word, r.flags)
    ]
    return torch.tensor(flat, dtype=torch.int64).view(-1, 8)


Move = tuple[int, int, int]
"""(bucket byte, bytes, address): the bucket's bytes ``[at, at + bytes)`` also go to
``address`` onwards, laid out as in the bucket (a receiver's tensor, contiguous as its bytes
in the bucket are)."""


def also_column(rows: torch.Tensor, base: int, moves: Sequence[Move]) -> torch.Tensor | None:
    """Where each row of a pack's table (:func:`table` of :func:`plan_rows`, the bucket at
    ``base`` their destination) also writes its bytes, so that every byte of ``moves`` is
    written exactly once (0: nowhere); None where that cannot be: no moves, moves that overlap
    (one bucket byte to two places), or a byte of a move that no row writes whole (a row across
    a move's end). The pack's rows never write a bucket byte twice (:func:`plan_rows`), so
    rows inside moves that write as many bytes as the moves hold write each of them once."""
    if not moves or not len(rows):
        return None
    starts, lengths, addresses = torch.tensor(sorted(moves), dtype=torch.int64).T.contiguous()
    ends = starts + lengths
    if bool((starts[1:] < ends[:-1]).any()):
        return None
    dst, n, count, dp = rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 5]
    at = dst - base
    i = (torch.searchsorted(starts, at, right=True) - 1).clamp(min=0)
    inside = (dst != 0) & (at >= starts[i]) & (at + (count - 1) * dp + n <= ends[i])
    if int((count * n)[inside].sum()) != int(lengths.sum()):
        return None
    return torch.where(inside, addresses[i] + at - starts[i], 0)


class SummedCopies:
    """``pairs`` copied by one launch that also takes the checksum of ``buffer[:nbytes]``;
    build once (:meth:`plan`) and :meth:`run` every version. ``rows``: the kernel's table
    (:func:`table`), with a ninth column of second destinations (:meth:`also`) or without."""

    def __init__(
        self, pairs: Sequence[Pair], rows: torch.Tensor, buffer: torch.Tensor, nbytes: int
    ):
        self.pairs = tuple(pairs)  # the table holds their addresses: keep them alive
        self.buffer = buffer
        self.nbytes = nbytes
        self.device = buffer.device
        self.blocks = len(rows)
        self.whole = whole_row_words(nbytes)
        self.rows = rows
        self._kernel = "copy_sum_also" if rows.shape[1] > 8 else "copy_sum"
        self._table = rows.to(self.device)

    @classmethod
    def plan(
        cls, pairs: Sequence[Pair], buffer: torch.Tensor, nbytes: int, *, destination: bool
    ) -> SummedCopies | None:
        """The fused copies, or None where they cannot be (no CuPy or GPU, a copy the kernel
        cannot take (:func:`~.copy_kernel.fits`), or :func:`plan_rows` says no)."""
        pairs = [(d, s) for d, s in pairs if d.numel()]
        if not copy_kernel.available(buffer.device) or nbytes == 0:
            return None
        if any(d.device != buffer.device or not copy_kernel.fits(d, s) for d, s in pairs):
            return None
        copies = spans_of(pairs)
        rows = plan_rows(copies, base=buffer.data_ptr(), nbytes=nbytes, destination=destination)
        return None if rows is None else cls(pairs, table(rows), buffer, nbytes)

    def also(self, moves: Sequence[Move]) -> SummedCopies | None:
        """A pack's copies writing ``moves`` too, in the same launch: each byte read once,
        written twice, summed once (None: :func:`also_column` says no). The caller keeps the
        memory the moves write into while it runs these."""
        if self.rows.shape[1] > 8:
            return None  # these copies write a second destination already
        column = also_column(self.rows, self.buffer.data_ptr(), moves)
        if column is None:
            return None
        rows = torch.cat([self.rows, column[:, None]], dim=1)
        return SummedCopies(self.pairs, rows, self.buffer, self.nbytes)

    def run(self) -> torch.Tensor:
        """Queue the copies; returns the checksum's reduction (as :func:`~.checksum.row_sums`)."""
        out = torch.zeros(2, dtype=torch.int64, device=self.device)
        copy_kernel.launch(
            self._kernel, self.device, self.blocks, self._table.data_ptr(), self.whole,
            out.data_ptr(),
        )  # fmt: skip
        return out


def landed_rows(rows: Sequence[Row]) -> list[Row]:
    """A receiver's read ``rows`` (:func:`plan_rows`, the bucket their source) as sum-only rows
    over the bytes the copies wrote, each word under its bucket word: the sum-only rows (bytes
    no copy moves) as they are, a span read twice summed at its first landing only, and the
    last word of a copy shorter than whole words summed in the bucket (where it landed, its
    other bytes belong to whatever follows the parameter)."""
    out = []
    for r in rows:
        if r.dst == 0:
            out.append(r)
            continue
        if r.flags & NO_SUM:
            continue
        whole = r.nbytes // _WORD * _WORD
        if whole:  # a box's bucket pitch rides in the destination pitch (flag 1)
            out.append(
                Row(r.dst, 0, whole, r.word, SUM_DESTINATION, r.rows, r.dst_pitch, r.src_pitch)
            )
        if whole < r.nbytes:  # only a span's bytes can end mid-word (boxes are whole words)
            out.append(
                r._replace(src=r.src + whole, dst=0, nbytes=_WORD, word=r.word + whole // _WORD)
            )
    return out


def rows_by_device(rows: Sequence[Row], starts: Sequence[tuple[int, D]]) -> dict[D, list[Row]]:
    """``rows`` by the device of the memory each sums (``src``), given where every tensor they
    sum in starts (``(address, device)``). A summed address is in a tensor starting at or below
    it, in one allocation of one device, where no other device's tensor can start: the closest
    start at or below it is on its device."""
    ordered = sorted(starts, key=lambda start: start[0])
    addresses = [address for address, _ in ordered]
    out: dict[D, list[Row]] = {}
    for row in rows:
        out.setdefault(ordered[bisect.bisect_right(addresses, row.src) - 1][1], []).append(row)
    return out


class LandedSums:
    """A receiver's reads of a bucket on another GPU, then the checksum of what they wrote:
    each GPU sums the words that landed in its parameters, the bucket's GPU the bytes no copy
    moves (:func:`landed_rows`), one launch each, the parts added when finished. Build once
    (:meth:`plan`) and :meth:`run` every version."""

    def __init__(self, pairs: Sequence[Pair], rows: list[Row], buffer: torch.Tensor, nbytes: int):
        self.batch = CopyBatch.of(pairs, reused=True)
        self.whole = whole_row_words(nbytes)
        starts = [(d.data_ptr(), d.device) for d, _ in pairs] + [(buffer.data_ptr(), buffer.device)]
        self._tables = [
            (d, len(r), table(r).to(d)) for d, r in rows_by_device(rows, starts).items()
        ]

    @classmethod
    def plan(cls, pairs: Sequence[Pair], buffer: torch.Tensor, nbytes: int) -> LandedSums | None:
        """The reads and their landed checksum, or None where a copy is not of the same bytes
        (a cast), a GPU lacks the kernel, or :func:`plan_rows` says no."""
        pairs = [(d, s) for d, s in pairs if d.numel()]
        devices = {d.device for d, _ in pairs} | {buffer.device}
        if nbytes == 0 or not all(copy_kernel.available(d) for d in devices):
            return None
        if not all(copy_kernel.tabled(d, s) for d, s in pairs):
            return None
        rows = plan_rows(spans_of(pairs), base=buffer.data_ptr(), nbytes=nbytes, destination=False)
        return None if rows is None else cls(pairs, landed_rows(rows), buffer, nbytes)

    def run(self) -> tuple[torch.Tensor, ...]:
        """Queue the copies and the sums behind them; returns the checksum's reduction in one
        part per GPU, each on its GPU (:data:`~.checksum.Sums`, added when finished). Not added
        on one GPU: torch's copy between GPUs orders both streams after each other, so the
        bucket's GPU would wait for our puts and sums, and the next bucket's crossings start
        behind its stream (0.4-0.9 ms a bucket across NVLink, 2 x H200)."""
        self.batch.run()  # leaves every destination GPU's stream behind its copies
        parts = []
        for device, blocks, rows in self._tables:
            out = torch.zeros(2, dtype=torch.int64, device=device)
            copy_kernel.launch(
                "copy_sum", device, blocks, rows.data_ptr(), self.whole, out.data_ptr()
            )
            parts.append(out)
        return tuple(parts)


def copies(
    pairs: Sequence[Pair],
    buffer: torch.Tensor,
    nbytes: int,
    *,
    destination: bool,
    names: Sequence[str] = (),
) -> SummedCopies | LandedSums | BlockedCopies | CopyBatch:
    """The copies of ``pairs`` to run every version: summing ``buffer[:nbytes]`` on the way
    where they can (``run()`` then returns the reduction; on CPU :class:`BlockedCopies`, whose
    ``run(check)`` also compares a pack with its sources, ``names`` naming each pair's
    tensor), reads into other GPUs summed where they landed (:class:`LandedSums`), else a
    plain :class:`CopyBatch` (``run()`` returns None: sum apart)."""
    if not buffer.is_cuda:
        blocked = BlockedCopies.plan(pairs, buffer, nbytes, destination=destination, names=names)
        if blocked is not None:
            return blocked
    summed = SummedCopies.plan(pairs, buffer, nbytes, destination=destination)
    if summed is None and not destination and any(d.device != buffer.device for d, _ in pairs):
        summed = LandedSums.plan(pairs, buffer, nbytes)
    return summed or CopyBatch.of(pairs, reused=True)
