"""Batched copies on CUDA move bits, not values: on bf16 views of random bytes the fused
``_foreach_copy_`` kernel changed some bit patterns (likely NaN payloads; found by the node
bench on H200)."""

from __future__ import annotations

import pytest
import torch

from weightsync.regions import CopyBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_batched_copies_of_byte_buffer_views_are_bit_exact(dtype):
    g = torch.Generator("cuda").manual_seed(0)
    src_flat = torch.empty(1 << 20, dtype=torch.uint8, device="cuda").random_(0, 256, generator=g)
    dst_flat = torch.zeros_like(src_flat)
    pairs, offset = [], 0
    for n in (7168, 1024, 65536, 3 << 18):
        pairs.append(
            (dst_flat[offset : offset + n].view(dtype), src_flat[offset : offset + n].view(dtype))
        )
        offset += n
    CopyBatch.of(pairs).run()
    torch.cuda.synchronize()
    assert torch.equal(dst_flat[:offset], src_flat[:offset])
