"""Trainer-side FP8 on a GPU (issue 36): ``BlockFp8`` (grouped small experts, big tensors
alone, a ragged one) writes on CUDA exactly what the reference ``quantize_block_fp8`` makes,
which equals vLLM's reference quantizer (tests/unit/test_fp8.py).

Run on a GPU machine: ``python -m pytest -m gpu tests/gpu/test_fp8_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from weightsync.fp8 import BlockFp8, quantize_block_fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("ue8m0", [False, True])
def test_block_fp8_on_cuda_equals_the_reference_quantizer(ue8m0):
    g = torch.Generator("cuda").manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g, device="cuda").bfloat16()

    weights = {f"experts.{i}.up_proj.weight": weight(768, 2048) for i in range(8)}
    weights["mlp.down_proj.weight"] = weight(3584, 18944)
    weights["attn.q_proj.weight"] = weight(300, 200)
    got = BlockFp8(ue8m0=ue8m0)(weights)
    for name, w in weights.items():
        values, scale = quantize_block_fp8(w, ue8m0=ue8m0)
        assert torch.equal(got[name].view(torch.uint8), values.view(torch.uint8)), name
        assert torch.equal(got[name.removesuffix("weight") + "weight_scale_inv"], scale), name
