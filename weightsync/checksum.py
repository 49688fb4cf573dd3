"""The per-bucket checksum: two integer reductions, cheap on CPU and GPU alike.

The bucket's bytes are viewed as int32 rows of 64 words (256 bytes, the alignment, so every
bucket length divides evenly). The checksum mixes the position-weighted sum of row sums with
the column sums, in wrapping 64-bit integer arithmetic. Wrapping addition is associative, so
the value is identical on CPU and CUDA whatever the reduction order; it catches flipped bits,
stale or shifted rows and swapped words within a row. It is not cryptographic.
"""

from __future__ import annotations

import torch

from weightsync.errors import ChecksumError

ALGORITHM = "ws-rowcol64-v1"
_ROW_WORDS = 64
_MASK64 = (1 << 64) - 1


def bucket_checksum(buffer: torch.Tensor, nbytes: int) -> int:
    """Checksum of ``buffer[:nbytes]`` (a flat uint8 tensor; ``nbytes`` a multiple of 256)."""
    if nbytes % (4 * _ROW_WORDS):
        raise ChecksumError(f"checksum needs a length that is a multiple of 256, got {nbytes}")
    if nbytes == 0:
        return 0
    words = buffer[:nbytes].view(torch.int32).view(-1, _ROW_WORDS)
    row_sums = words.sum(dim=1, dtype=torch.int64)
    weights = torch.arange(1, row_sums.numel() + 1, device=buffer.device, dtype=torch.int64)
    col_sums = words.sum(dim=0, dtype=torch.int64)
    col_weights = torch.arange(1, _ROW_WORDS + 1, device=buffer.device, dtype=torch.int64)
    mixed = torch.stack([(row_sums * weights).sum(), (col_sums * col_weights).sum()]).cpu()
    a, b = (int(x) & _MASK64 for x in mixed.tolist())
    # Odd multipliers keep the two halves from cancelling each other.
    return (a * 0x9E3779B97F4A7C15 + b * 0xC2B2AE3D27D4EB4F + nbytes) & _MASK64
