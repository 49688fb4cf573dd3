"""Buckets for the copies that take the checksum on the way (``weightsync.summed_copies``),
shared by the test of the kernel on the GPU and of its source run on the CPU.

Odd lengths, ends 8- but not 16-byte aligned, a tensor of several table rows, stale bytes in
the padding, and a bucket long enough for both kinds of checksum rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightsync.summed_copies import CHUNK_BYTES

Pair = tuple[torch.Tensor, torch.Tensor]

# (bytes, dtype, skew of the tensor outside the bucket)
_TENSORS = [
    (6, torch.uint8, 0),
    (2 * 1001, torch.bfloat16, 8),
    (3 * CHUNK_BYTES + 40, torch.float32, 0),
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


def moved(case: Case) -> bool:
    return all(torch.equal(d.view(torch.uint8), s.view(torch.uint8)) for d, s in case.pairs)
