"""How one bucket's new bytes differ from its previous ones (:mod:`weightsync.deltas`' scan):
the sizes of each delta form and the parts of the one chosen, in a few whole-tensor torch ops,
no Python per element or run. Two ways to the same parts, bit for bit:

- :func:`sparse` (CPU): compare 8-byte words, then work on the changed ones only. On CPU every
  pass over the bucket costs; here there are two (the comparison and the ``nonzero`` of its
  mask), the rest touches only the changed words (under a tenth of them for an Adam step at
  lr 1e-6). Twice the speed of comparing elements and words apart.
- :func:`dense` (CUDA): the sizes and both checksums from one read of the two versions (the
  delta scan kernel, :mod:`.delta_kernel_source`, where CuPy is; else masks of the whole
  bucket), and one copy to the host for all of them: the only sync, the one that sizes the
  payload. The ``indices`` form's parts then come from a second kernel (one more read, each
  block writing from the counts of the blocks before it); the ``xor`` form's, and both where
  there is no kernel, from masks and ``nonzero_static`` of the known sizes (no sync), made only
  for the form chosen.

The XOR form's runs follow from the positions of the changed 32-bit words: consecutive changed
words ``d`` apart share a run when ``d <= GAP_WORDS + 1`` (the ``d - 1`` zero words between
them travel inside it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weightsync import copy_kernel
from weightsync.checksum import finish, row_sums, whole_row_words
from weightsync.delta_kernel_source import SCAN_VALUES

GAP_WORDS = 2
"""Zero words kept inside an XOR run rather than starting a new one (a run costs 8 bytes)."""
UNITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
"""The integer dtype of each element size the ``indices`` form compares and carries."""


@dataclass(frozen=True)
class Scan:
    """What a delta from ``old`` to ``new`` would carry, and how to build its parts."""

    changed: int
    """Elements that differ."""
    runs: int
    """XOR runs."""
    covered: int
    """32-bit words inside the runs."""
    base_checksum: int
    checksum: int
    indices: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    """The ``indices`` form's parts: int32 flat indices, the new values."""
    xor: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """The ``xor`` form's parts: int32 starts, int32 lengths, int32 words."""


def checksum_of(data: torch.Tensor) -> int:
    """The bucket checksum of ``data``'s bytes (flat uint8)."""
    return finish(row_sums(data, data.numel()), data.numel())


def sparse(old: torch.Tensor, cur: torch.Tensor, unit: int) -> Scan:
    """The scan of two flat uint8 tensors (8-byte aligned, of a length that is a multiple of
    256), through the changed 8-byte words."""
    wo, wc = old.view(torch.int64), cur.view(torch.int64)
    at = torch.nonzero(wo != wc).flatten()  # the changed wide words
    new = wc.index_select(0, at)
    x = wo.index_select(0, at) ^ new
    per, halves = 8 // unit, 2
    element = x.view(UNITS[unit]) != 0  # each changed word's elements, changed or not
    nonzero_words = torch.nonzero(x.view(torch.int32) != 0).flatten()
    positions = _spread(at, nonzero_words, halves)  # of the changed 32-bit words
    runs, covered = _run_sizes(positions)

    def indices() -> tuple[torch.Tensor, torch.Tensor]:
        picked = torch.nonzero(element).flatten()
        values = new.view(UNITS[unit]).index_select(0, picked)
        return _spread(at, picked, per).to(torch.int32), values

    def xor() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        values = x.view(torch.int32).index_select(0, nonzero_words)
        return _xor_parts(positions, values, runs, covered)

    changed = int(torch.count_nonzero(element))
    return Scan(changed, runs, covered, checksum_of(old), checksum_of(cur), indices, xor)


def dense(old: torch.Tensor, cur: torch.Tensor, unit: int) -> Scan:
    """The scan of two flat uint8 tensors through one read of both (:meth:`_Grid.scan`, the
    delta scan kernel) or masks of the whole of them (torch), with one copy to the host (the
    sizes and both checksums together)."""
    wo, wc = old.view(torch.int32), cur.view(torch.int32)

    @functools.cache
    def words() -> torch.Tensor:
        return wo != wc

    @functools.cache
    def element() -> torch.Tensor:
        return words() if unit == 4 else old.view(UNITS[unit]) != cur.view(UNITS[unit])

    nbytes = old.numel()
    kernel = copy_kernel.available(old.device) and not (old.data_ptr() | cur.data_ptr()) % 16
    grid = _Grid.of(old) if kernel else None
    got = grid.scan(old, cur, unit) if grid else _counted(old, cur, words(), element())
    changed, nonzero, near = got[0], got[1], got[2 : 3 + GAP_WORDS]
    runs = nonzero - sum(near)  # each pair of consecutive changed words <= GAP+1 apart joins
    covered = nonzero + sum((d - 1) * k for d, k in enumerate(near, 1))  # and the d - 1 between
    base, checksum = (
        finish(torch.tensor(got[i : i + 2]), nbytes) for i in (3 + GAP_WORDS, 5 + GAP_WORDS)
    )

    def indices() -> tuple[torch.Tensor, torch.Tensor]:
        if grid:
            return grid.indices(old, cur, unit, changed)
        picked = torch.nonzero_static(element(), size=changed).flatten()
        return picked.to(torch.int32), cur.view(UNITS[unit])[picked]

    def xor() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        positions = torch.nonzero_static(words(), size=nonzero).flatten()
        values = wo[positions] ^ wc[positions]
        return _xor_parts(positions, values, runs, covered)

    return Scan(changed, runs, covered, base, checksum, indices, xor)


@dataclass
class _Grid:
    """The delta kernels' blocks over one bucket, each a contiguous chunk of ``chunk`` 16-byte
    pairs of words, the same for the scan and the writes of the ``indices`` form's parts."""

    blocks: int
    chunk: int
    counts: torch.Tensor | None = None
    """Each block's changed elements, from :meth:`scan`."""

    @classmethod
    def of(cls, old: torch.Tensor) -> _Grid:
        n16 = old.numel() // 16
        most = _BLOCKS_PER_SM * _multiprocessors(old.device.index)
        blocks = max(1, min(-(-n16 // (copy_kernel.THREADS * _PAIRS_PER_THREAD)), most))
        chunk = max(1, -(-n16 // blocks))
        return cls(max(1, -(-n16 // chunk)), chunk)

    def scan(self, old: torch.Tensor, cur: torch.Tensor, unit: int) -> list[int]:
        """:func:`dense`'s numbers from one launch of the delta scan kernel: [changed elements,
        changed words, the consecutive changed words 1 .. GAP_WORDS + 1 apart, both versions'
        checksum sums]. The copy to the host is the one sync."""
        out = torch.zeros(SCAN_VALUES, dtype=torch.int64, device=old.device)
        self.counts = torch.empty(self.blocks, dtype=torch.int64, device=old.device)
        copy_kernel.launch(
            "delta_scan", old.device, self.blocks, old.data_ptr(), cur.data_ptr(),
            old.numel() // 8, whole_row_words(old.numel()), unit, out.data_ptr(), self.chunk,
            self.counts.data_ptr(),
        )  # fmt: skip
        return out.tolist()

    def indices(
        self, old: torch.Tensor, cur: torch.Tensor, unit: int, changed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``indices`` form's parts (``changed`` of them, as :meth:`scan` counted): one
        more read of both versions, no sync. Both are views of one allocation of the bucket's
        size (the form travels only when smaller), end to end as the payload lays them: the
        allocator hands the same block back every version, and the payload needs no copy."""
        size = max(old.numel(), changed * (4 + unit))
        held = torch.empty(size, dtype=torch.uint8, device=old.device)
        idx = held[: changed * 4].view(torch.int32)
        values = held[changed * 4 : changed * (4 + unit)].view(UNITS[unit])
        if changed:
            offsets = torch.cumsum(self.counts, 0) - self.counts
            copy_kernel.launch(
                "delta_indices", old.device, self.blocks, old.data_ptr(), cur.data_ptr(),
                old.numel() // 8, unit, self.chunk, offsets.data_ptr(), idx.data_ptr(),
                values.data_ptr(),
            )  # fmt: skip
        return idx, values


_PAIRS_PER_THREAD = 4
"""16-byte pairs of words each thread of the scan reads per launch, where the grid is not
capped."""
_BLOCKS_PER_SM = 2
"""Blocks of the delta kernels per multiprocessor at most (threads then walk the chunk in
strides). Each block adds its nine sums once; on an H200 1-2 blocks per SM scanned a 256 MiB
bucket at 2.2 TB/s, 4096 blocks at 1.7 TB/s, 32 MiB at 1.7 against 0.6 TB/s (2026-11-29)."""


@functools.cache
def _multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _counted(
    old: torch.Tensor, cur: torch.Tensor, words: torch.Tensor, element: torch.Tensor
) -> list[int]:
    """:meth:`_Grid.scan`'s numbers from torch's whole-bucket masks."""
    counts = [torch.count_nonzero(element), torch.count_nonzero(words)]
    n = words.numel()
    # ``alone[i]``: word i changed and the d - 1 words after it did not; with word i + d
    # changed too, the two are consecutive changed words d apart.
    alone = words[: n - 1]
    for d in range(1, GAP_WORDS + 2):
        counts.append(torch.count_nonzero(alone[: n - d] & words[d:]))
        alone = alone[: n - d - 1] & ~words[d : n - 1]
    nbytes = old.numel()
    return torch.cat([torch.stack(counts), row_sums(old, nbytes), row_sums(cur, nbytes)]).tolist()


def covered_words(starts: torch.Tensor, lengths: torch.Tensor, covered: int) -> torch.Tensor:
    """The positions of the ``covered`` words the runs cover, in order (no sync)."""
    offsets = torch.cumsum(lengths, 0, dtype=torch.int64) - lengths
    first = torch.repeat_interleave(starts - offsets, lengths.long(), output_size=covered)
    return first + torch.arange(covered, device=starts.device)


def _spread(at: torch.Tensor, picked: torch.Tensor, per: int) -> torch.Tensor:
    """Flat positions, in units ``per`` to a wide word, of the ``picked`` units of the wide
    words at ``at`` (``picked`` counts units through ``at``'s words, in order)."""
    shift = per.bit_length() - 1  # per is a power of two: shifts, not slow integer division
    return (at.index_select(0, picked >> shift) << shift) | (picked & (per - 1))


def _run_sizes(positions: torch.Tensor) -> tuple[int, int]:
    """Runs and covered words of changed 32-bit words at ``positions`` (ascending)."""
    if not positions.numel():
        return 0, 0
    gaps = positions[1:] - positions[:-1]
    joined = gaps <= GAP_WORDS + 1
    return positions.numel() - int(torch.count_nonzero(joined)), positions.numel() + int(
        ((gaps - 1) * joined).sum()
    )


def _xor_parts(
    positions: torch.Tensor, values: torch.Tensor, runs: int, covered: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The runs' starts, lengths and words (zero between changed words) of the changed words
    ``values`` at ``positions`` (ascending), ``runs`` runs covering ``covered`` words."""
    device = positions.device
    if not runs:
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        return empty, empty, empty
    apart = (positions[1:] - positions[:-1]) > GAP_WORDS + 1
    if device.type == "cuda":
        breaks = torch.nonzero_static(apart, size=runs - 1).flatten() + 1
    else:  # nonzero_static is several times slower than nonzero on CPU
        breaks = torch.nonzero(apart).flatten() + 1
    head = torch.zeros(1, dtype=breaks.dtype, device=device)
    first = positions[torch.cat([head, breaks])]
    last = positions[torch.cat([breaks - 1, head + positions.numel() - 1])]
    lengths = last - first + 1
    offsets = torch.cumsum(lengths, 0) - lengths
    run = torch.cat([head, torch.cumsum(apart, 0)])  # each changed word's run
    words = torch.zeros(covered, dtype=torch.int32, device=device)
    words[positions - first[run] + offsets[run]] = values
    return first.to(torch.int32), lengths.to(torch.int32), words
