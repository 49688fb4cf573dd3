"""The per-bucket checksum: one integer reduction pass, cheap on CPU and GPU alike.

The bucket's bytes are viewed as int64 words in rows of 32 (256 bytes, the alignment, so every
bucket length divides evenly). Row sums are taken in one pass (wrapping 64-bit arithmetic, no
upcast, no temporary the size of the bucket); they are then mixed with their row positions.
Wrapping addition is associative, so the value is identical on CPU and CUDA whatever the
reduction order. It catches flipped bits, stale, missing or shifted rows and words moved
between rows; it does not see two words swapped inside one 256-byte row, a trade for reading
every byte only once. It is not cryptographic.
"""

from __future__ import annotations

import torch

from weightsync.errors import ChecksumError

ALGORITHM = "ws-rows64-v2"
_ROW_WORDS = 32
_ROW_BYTES = 8 * _ROW_WORDS
_MASK64 = (1 << 64) - 1
_BLOCK = 4096


def row_sums(buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The checksum's reduction of ``buffer[:nbytes]``, left on the buffer's device (no sync):
    queue it behind the copies that fill or read the buffer, finish it once per version."""
    if nbytes % _ROW_BYTES:
        raise ChecksumError(f"checksum needs a length that is a multiple of 256, got {nbytes}")
    if nbytes == 0:
        return torch.zeros(2, dtype=torch.int64, device=buffer.device)
    sums = buffer[:nbytes].view(torch.int64).view(-1, _ROW_WORDS).sum(dim=1)
    # sum((r + 1) * sums[r]) without a positions tensor as long as `sums`: with r = b*K + j,
    # it is K * sum(b * block_b) + sum((j + 1) * column_j) (+ the rows after the last block),
    # the same value modulo 2**64, from temporaries of K and R/K entries.
    rows = sums.numel()
    blocks, tail = divmod(rows, _BLOCK)
    step = torch.arange(1, _BLOCK + 1, device=buffer.device, dtype=torch.int64)
    weighted = torch.zeros((), dtype=torch.int64, device=buffer.device)
    if blocks:
        grid = sums[: blocks * _BLOCK].view(blocks, _BLOCK)
        index = torch.arange(blocks, device=buffer.device, dtype=torch.int64)
        weighted = (grid.sum(dim=0) * step).sum() + (grid.sum(dim=1) * index).sum() * _BLOCK
    if tail:
        weighted = weighted + (sums[blocks * _BLOCK :] * (step[:tail] + blocks * _BLOCK)).sum()
    return torch.stack([weighted, sums.sum()])


def finish(sums: torch.Tensor, nbytes: int) -> int:
    """The checksum from :func:`row_sums` (moved to the CPU: waits for it)."""
    if nbytes == 0:
        return 0
    a, b = (int(x) & _MASK64 for x in sums.cpu().tolist())
    # Odd multipliers keep the two halves from cancelling each other.
    return (a * 0x9E3779B97F4A7C15 + b * 0xC2B2AE3D27D4EB4F + nbytes) & _MASK64


def bucket_checksum(buffer: torch.Tensor, nbytes: int) -> int:
    """Checksum of ``buffer[:nbytes]`` (a flat uint8 tensor; ``nbytes`` a multiple of 256)."""
    return finish(row_sums(buffer, nbytes), nbytes)
