"""``verify_copies`` / ``verify_entry``: pack copies compared with their sources, bit for bit."""

from __future__ import annotations

import pytest
import torch

from weightsync.buckets import TensorSpec, pack_entry, plan_buckets
from weightsync.checksum import verify_copies, verify_entry
from weightsync.errors import ChecksumError


def test_an_entry_packed_right_passes_and_one_flipped_bit_is_named():
    tensor = torch.randn(1000, 3)
    (bucket,) = plan_buckets((TensorSpec.of("w", tensor),), 1 << 20).buckets
    (entry,) = bucket.entries
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pack_entry(buffer, entry, tensor)
    verify_entry("version 3, bucket 0", buffer, entry, tensor)
    buffer[entry.offset + entry.nbytes - 1] ^= 0x80
    with pytest.raises(ChecksumError, match="version 3, bucket 0: tensor 'w' was packed wrong"):
        verify_entry("version 3, bucket 0", buffer, entry, tensor)


def test_strided_cast_and_nan_copies_compare_by_bits():
    nan = torch.full((8, 6), float("nan"), dtype=torch.bfloat16)[:, ::2]  # strided, NaN
    dst = torch.empty(8, 3, dtype=torch.bfloat16)
    dst.copy_(nan)
    wide = torch.randn(4, 4)
    narrow = torch.empty(4, 4, dtype=torch.bfloat16)
    narrow.copy_(wide)  # a cast copy: compared with the source cast the same way
    verify_copies("v", "t", [(dst, nan), (narrow, wide)])
    narrow.view(torch.int16)[2, 2] ^= 1
    with pytest.raises(ChecksumError, match="tensor 't'"):
        verify_copies("v", "t", [(dst, nan), (narrow, wide)])
