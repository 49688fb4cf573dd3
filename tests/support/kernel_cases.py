"""Copies for our CUDA kernels (``weightsync/copy_kernel.py``), shared by their tests on the
GPU and of their source run on the CPU (``cuda_on_cpu``).

- :func:`strided`: copies of every shape ``copy_chunks`` takes.
- :func:`packing`, :func:`reading`: buckets for the copies that take the checksum on the way
  (``weightsync.summed_copies``): odd lengths, ends 8- but not 16-byte aligned, a tensor of
  several table rows, stale bytes in the padding, and a bucket long enough for both kinds of
  checksum rows.
- :func:`columns`: a bucket packed from TP=2 shards of its tensors' columns (boxes), rows
  16- and only 8-byte aligned, rows wider than a table row, boxes of several table rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from weightsync import copy_kernel

Pair = tuple[torch.Tensor, torch.Tensor]

# (bytes, dtype, skew of the tensor outside the bucket)
_TENSORS = [
    (6, torch.uint8, 0),
    (2 * 1001, torch.bfloat16, 8),
    (3 * copy_kernel.CHUNK_BYTES + 40, torch.float32, 0),
    (8, torch.int64, 24),
    (70_002, torch.bfloat16, 16),
]


@dataclass
class Case:
    bucket: torch.Tensor
    nbytes: int
    pairs: list[Pair]
    flip: int
    """The last byte of a tensor whose last word is partial (padding follows it)."""


def _random(n: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


def _layout() -> tuple[list[tuple[int, int, torch.dtype, int]], int]:
    """(offset in the bucket, bytes, dtype, offset outside) per tensor, and the bucket size."""
    out, at, outside = [], 0, 0
    for n, dtype, skew in _TENSORS:
        outside += skew
        out.append((at, n, dtype, outside))
        at = -(-(at + n) // 256) * 256
        outside = -(-(outside + n) // 64) * 64
    return out, at


def packing(device: str) -> Case:
    """The sender packing a bucket (its destination) over stale bytes from an earlier one."""
    layout, nbytes = _layout()
    bucket = _random(nbytes + 512, 1, device)
    outside = _random(nbytes + 4096, 2, device)
    pairs = [
        (bucket[at : at + n].view(dtype), outside[o : o + n].view(dtype))
        for at, n, dtype, o in layout
    ]
    at, n = layout[-1][:2]
    return Case(bucket, nbytes, pairs, at + n - 1)


def reading(device: str) -> Case:
    """A receiver reading a bucket (its source): one tensor it does not keep, one it reads
    into two parameters (tied weights)."""
    layout, nbytes = _layout()
    bucket = _random(nbytes, 3, device)
    params = torch.zeros(nbytes * 2 + 4096, dtype=torch.uint8, device=device)
    pairs = [
        (params[o : o + n].view(dtype), bucket[at : at + n].view(dtype))
        for i, (at, n, dtype, o) in enumerate(layout)
        if i != 2
    ]
    at, n, dtype, _ = layout[-1]
    pairs.append((params[nbytes + 512 : nbytes + 512 + n].view(dtype), pairs[-1][1]))
    return Case(bucket, nbytes, pairs, at + n - 1)


# (rows, columns of each of the two shards, dtype): a TP=2 trainer's row-parallel weights
_SHARDED = [
    (64, 48, torch.bfloat16),  # 96-byte rows: 16-byte units
    (32, 12, torch.float16),  # 24-byte shard rows: 8-byte units
    (2, 300_000, torch.uint8),  # a shard row wider than a table row
    (5000, 32, torch.bfloat16),  # several table rows of whole rows
]


def columns(device: str) -> Case:
    """The sender packing a bucket from TP=2 shards: each tensor's two halves of every row
    come from two separate shards, and a contiguous tensor sits between them."""
    bucket = _random(6 << 20, 5, device)
    outside = _random(6 << 20, 6, device)
    pairs, at, o = [], 0, 0
    for rows, cols, dtype in _SHARDED:
        whole = bucket[at:].view(dtype)[: rows * 2 * cols].view(rows, 2 * cols)
        for half in range(2):
            n = rows * cols * whole.element_size()
            shard = outside[o : o + n].view(dtype).view(rows, cols)
            pairs.append((whole[:, half * cols : (half + 1) * cols], shard))
            o = -(-(o + n) // 64) * 64
        at = -(-(at + whole.nbytes) // 256) * 256
        pairs.append((bucket[at : at + 1003], outside[o : o + 1003]))
        at, o = at + 1024, o + 1024
    return Case(bucket, at, pairs, at - 1024 + 1002)


SUMMED = pytest.mark.parametrize(
    ("make", "destination"),
    [(packing, True), (reading, False), (columns, True)],
    ids=["packing", "reading", "packing TP shards' columns"],
)
"""The cases of the copies that take the checksum, as (case maker, the bucket is the copies'
destination), for the CPU and the GPU tests alike."""


def moved(case: Case) -> bool:
    return all(torch.equal(d.view(torch.uint8), s.view(torch.uint8)) for d, s in case.pairs)


def weights_of(case: Case, skew: int = 8) -> tuple[list[tuple[int, int, int]], torch.Tensor]:
    """A receiver's weights for a packing ``case``: one contiguous tensor per tensor of the
    bucket (the union of the bytes its pairs write there), each ``skew`` bytes past a 16-byte
    boundary in one zeroed buffer. Returns the moves (bucket byte, bytes, address) that write
    them (``summed_copies.Move``) and the buffer."""
    base = case.bucket.data_ptr()
    extents = []
    for d, _ in case.pairs:
        last = sum((n - 1) * st for n, st in zip(d.shape, d.stride(), strict=True))
        start = d.data_ptr() - base
        extents.append((start, start + (last + 1) * d.element_size()))
    merged: list[list[int]] = []
    for start, end in sorted(extents):  # a TP shard's columns beside the other's: one tensor
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    sizes = [-(-(end - start + skew) // 16) * 16 for start, end in merged]
    weights = torch.zeros(sum(sizes), dtype=torch.uint8, device=case.bucket.device)
    moves, at = [], 0
    for (start, end), size in zip(merged, sizes, strict=True):
        moves.append((start, end - start, weights.data_ptr() + at + skew))
        at += size
    return moves, weights


def written(case: Case, moves: list[tuple[int, int, int]], weights: torch.Tensor) -> bool:
    """Every move's bytes in ``weights`` equal the bucket's, and no other byte was written."""
    expected = torch.zeros_like(weights)
    for start, n, address in moves:
        at = address - weights.data_ptr()
        expected[at : at + n] = case.bucket[start : start + n]
    return torch.equal(weights, expected)


STRIDED_BYTES = (3_000_000, 3_100_000)
"""The sizes of the byte buffers ``a`` and ``b`` that :func:`strided` takes."""


def strided(a: torch.Tensor, b: torch.Tensor) -> list[Pair]:
    """(destination in byte buffer ``a``, source in ``b``) of every shape the kernel takes:
    column shards either way, a stack of them, rows wider than a table row, rows aligned to
    16, 8, 4, 2 and 1 bytes, boxes of many units per thread, a contiguous copy of many table
    rows, a scalar."""
    at = 0

    def piece(n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        nonlocal at
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        view = b[at : at + nbytes].view(dtype)
        at += -(-nbytes // 16) * 16
        return view

    bf16 = a[: 64 << 10].view(torch.bfloat16).view(64, 512)
    stack = a[64 << 10 : 192 << 10].view(torch.bfloat16).view(4, 64, 256)
    wide = a[192 << 10 : (192 << 10) + 3 * 400_000].view(3, 400_000)
    odd = a[1_500_000:1_504_096].view(64, 64)
    flat = a[1_600_000 : 1_600_000 + 2 * copy_kernel.CHUNK_BYTES + 100]
    scalar = a[2_200_002:2_200_004].view(torch.bfloat16).view(())
    packed = a[2_300_000 : 2_300_000 + 64 * 128 * 2].view(torch.bfloat16).view(64, 128)
    sharded = b[3_000_000 : 3_000_000 + (64 << 10)].view(torch.bfloat16).view(64, 512)
    # Boxes whose threads take several units each: rows narrower than a block (96 bytes) and
    # wider (20,000 bytes), as a TP=2 trainer's o_proj and down_proj shards are.
    tall = a[2_400_000 : 2_400_000 + 1000 * 192].view(torch.bfloat16).view(1000, 96)
    long = a[2_600_000 : 2_600_000 + 10 * 40_000].view(torch.bfloat16).view(10, 20_000)
    return [
        (bf16[:, 128:256], piece(64 * 128, torch.bfloat16).view(64, 128)),
        (bf16[:, 384:448], piece(64 * 64, torch.bfloat16).view(64, 64)),
        (bf16[:, 4:68], piece(64 * 64, torch.bfloat16).view(64, 64)),  # rows 8-byte aligned
        (bf16[:, 70:72], piece(64 * 2, torch.bfloat16).view(64, 2)),  # 4-byte aligned
        (stack[:, :, 8:24], piece(4 * 64 * 16, torch.bfloat16).view(4, 64, 16)),
        (wide[:, 1000:301_000], piece(3 * 300_000).view(3, 300_000)),
        (odd[:, 5:8], piece(64 * 3).view(64, 3)),
        (odd[:, 10:16].view(torch.int16), piece(64 * 3, torch.int16).view(64, 3)),
        (flat, piece(flat.numel())),
        (scalar, piece(1, torch.bfloat16).view(())),
        (packed, sharded[:, 256:384]),
        (tall[:, 48:], piece(1000 * 48, torch.bfloat16).view(1000, 48)),
        (long[:, 10_000:], piece(10 * 10_000, torch.bfloat16).view(10, 10_000)),
    ]
