"""Trainer-side FP8 on a GPU (issue 36): ``BlockFp8`` writes on CUDA exactly what the
reference ``quantize_block_fp8`` makes there (torch's ops, which equal vLLM's reference
quantizer: tests/unit/test_fp8.py): bf16 weights in one launch of the block FP8 kernel (whole
tiles, a ragged weight, a column slice with a pitch, a misaligned slice, small experts), a
float32 one through torch's ops; the kernel's table is kept while the weights stay where they
are and rebuilt when they move.

Run on a GPU machine: ``python -m pytest -m gpu tests/gpu/test_fp8_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from weightsync import copy_kernel
from weightsync.fp8 import BlockFp8, quantize_block_fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator("cuda").manual_seed(seed)

    def weight(rows: int, cols: int, dtype=torch.bfloat16) -> torch.Tensor:
        exponent = torch.randint(-24, 4, (rows, cols), generator=g, device="cuda")
        return (torch.randn(rows, cols, generator=g, device="cuda") * 2.0**exponent).to(dtype)

    weights = {f"experts.{i}.up_proj.weight": weight(768, 2048) for i in range(8)}
    weights["mlp.down_proj.weight"] = weight(3584, 18944)
    weights["attn.q_proj.weight"] = weight(300, 200)
    wide = weight(512, 1024)
    weights["attn.o_proj.weight"] = wide[:, 256:768]
    weights["attn.k_proj.weight"] = wide[:128, 1:129]
    weights["attn.v_proj.weight"] = weight(256, 256, torch.float32)
    return weights


def _check(fp8: BlockFp8, got: dict, weights: dict, ue8m0: bool) -> None:
    for name, w in weights.items():
        values, scale = quantize_block_fp8(w, ue8m0=ue8m0)
        assert torch.equal(got[name].view(torch.uint8), values.view(torch.uint8)), name
        assert torch.equal(got[name.removesuffix("weight") + "weight_scale_inv"], scale), name


@pytest.mark.parametrize("ue8m0", [False, True])
def test_block_fp8_on_cuda_equals_the_reference_quantizer(ue8m0):
    weights = _weights(0)
    fp8 = BlockFp8(ue8m0=ue8m0)
    got = fp8(weights)
    _check(fp8, got, weights, ue8m0)
    if copy_kernel.available(torch.device("cuda")):
        assert fp8.launched == {n for n, w in weights.items() if w.dtype == torch.bfloat16}
    # New values at the same addresses (the kept table), then weights that moved.
    for name, w in _weights(1).items():
        weights[name].copy_(w)
    _check(fp8, fp8(weights), weights, ue8m0)
    moved = _weights(2)
    _check(fp8, fp8(moved), moved, ue8m0)


def test_its_ready_events_name_every_tensor_by_the_launch_that_writes_it(monkeypatch):
    """``BlockFp8.ready`` (for ``publish(..., ready=...)``): every tensor it gives, the
    quantized ones by the event of their own launch (several launches here), the rest by
    the event recorded before the first; the same mapping again for the same tensors, and
    every event fired once the GPU is done."""
    from weightsync import fp8 as fp8_module

    monkeypatch.setattr(fp8_module, "LAUNCH_BYTES", 2 << 20)
    weights = _weights(0)
    weights["norm.weight"] = torch.ones(64, device="cuda")
    fp8 = BlockFp8()
    got = fp8(weights)
    ready = fp8.ready
    assert ready is not None and ready.keys() == got.keys()
    launched = sorted(fp8.launched)
    events = {id(ready[n]) for n in launched}
    assert 1 < len(events) < len(launched)  # several launches, each of several weights
    for name in launched:
        assert ready[name] is ready[name.removesuffix("weight") + "weight_scale_inv"]
    assert ready["norm.weight"] is not ready[launched[0]]
    assert ready["attn.v_proj.weight"] is not ready["norm.weight"]  # float32: torch's ops
    fp8(dict(weights))
    assert fp8.ready is ready
    torch.cuda.synchronize()
    assert all(event.query() for event in ready.values())
    _check(fp8, got, {n: w for n, w in weights.items() if n != "norm.weight"}, False)
