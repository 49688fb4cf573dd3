"""Block FP8 (issue 36, trainer-side FP8): our quantizer equals the engines' reference
quantizer bit for bit, values and scales, on shapes that fill the blocks and shapes that do
not, from bf16 and float32, with plain and with UE8M0 (power-of-two) scales."""

from __future__ import annotations

import pytest
import torch

from weightsync.fp8 import FP8, BlockFp8, dequantize_block_fp8, quantize_block_fp8, scale_name

SHAPES = [(256, 128), (300, 200), (1, 7), (128, 1000)]


def _weight(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w[0, 0] = 3.0  # one large value: its block's scale differs from the others'
    w[128:, 128:] = 0.0  # whole blocks of zeros (where the shape has them): the amax floor
    return w.to(dtype)


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_vllms_reference_quantizer(shape, dtype, ue8m0):
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    w = _weight(shape, dtype, seed=sum(shape))
    values, scale_inv = quantize_block_fp8(w, ue8m0=ue8m0)
    ref_values, ref_scale = per_block_cast_to_fp8(w, [128, 128], use_ue8m0=ue8m0)
    assert values.dtype == FP8 and values.shape == w.shape
    assert scale_inv.dtype == torch.float32
    assert scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert torch.equal(values.view(torch.uint8), ref_values.view(torch.uint8))
    assert torch.equal(scale_inv, ref_scale)


def test_dequantizes_back_within_e4m3s_precision():
    w = _weight((300, 200), torch.float32, seed=1)
    values, scale_inv = quantize_block_fp8(w)
    back = dequantize_block_fp8(values, scale_inv)
    # e4m3 keeps 3 mantissa bits: within 1/16 of each value, plus a block's smallest step
    step = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200] * 2**-9
    assert bool(((back - w).abs() <= w.abs() / 16 + step).all())


def test_refuses_what_it_cannot_quantize_naming_it():
    with pytest.raises(ValueError, match=r"not \(4,\) torch.float32"):
        quantize_block_fp8(torch.zeros(4))
    with pytest.raises(ValueError, match="torch.int64"):
        quantize_block_fp8(torch.zeros(4, 4, dtype=torch.int64))


def test_block_fp8_quantizes_the_projections_into_buffers_kept_across_versions():
    g = torch.Generator().manual_seed(3)
    weights = {
        "model.embed_tokens.weight": torch.randn(300, 256, generator=g).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(256, 256, generator=g).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(256, 200, generator=g).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.randn(256, generator=g).bfloat16(),
    }
    fp8 = BlockFp8()
    first = fp8(weights)
    assert sorted(first) == sorted(
        [
            *weights,
            "model.layers.0.self_attn.q_proj.weight_scale_inv",
            "model.layers.0.mlp.down_proj.weight_scale_inv",
        ]
    )
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        values, scale = quantize_block_fp8(weights[f"{name}.weight"])
        assert torch.equal(first[f"{name}.weight"].view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(first[f"{name}.weight_scale_inv"], scale)
    assert first["model.embed_tokens.weight"] is weights["model.embed_tokens.weight"]
    ptrs = {n: t.data_ptr() for n, t in first.items() if n not in weights or "proj" in n}
    again = fp8({n: t * 2 for n, t in weights.items()})
    assert {n: again[n].data_ptr() for n in ptrs} == ptrs  # the same memory every version
    made = [t for n, t in again.items() if n not in weights or "proj" in n]
    assert len({t.untyped_storage().data_ptr() for t in made}) == 1  # one storage to offer
    values, _ = quantize_block_fp8(weights["model.layers.0.self_attn.q_proj.weight"] * 2)
    got = again["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(got.view(torch.uint8), values.view(torch.uint8))
    assert fp8.ready is None  # no GPU: nothing to wait for (tests/gpu/test_fp8_gpu.py)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_block_fp8_quantizes_experts_together_exactly_as_one_by_one(ue8m0):
    """A MoE model's experts (one shape, whole blocks) go in groups; the result is each
    tensor's own quantization, bit for bit, ragged ones included."""
    g = torch.Generator().manual_seed(4)
    weights = {
        f"model.layers.0.mlp.experts.{e}.{p}_proj.weight": (
            torch.randn(256, 128, generator=g) * (e + 1)
        ).bfloat16()
        for e in range(6)
        for p in ("gate", "up")
    }
    weights["model.layers.0.mlp.experts.0.down_proj.weight"] = torch.randn(
        130, 256, generator=g
    ).bfloat16()
    got = BlockFp8(ue8m0=ue8m0)(weights)
    for name, weight in weights.items():
        values, scale = quantize_block_fp8(weight, ue8m0=ue8m0)
        assert torch.equal(got[name].view(torch.uint8), values.view(torch.uint8)), name
        assert torch.equal(got[name.removesuffix("weight") + "weight_scale_inv"], scale), name


def test_block_fp8_names_a_picked_tensor_it_cannot_quantize():
    fp8 = BlockFp8(quantized=lambda name, t: True)
    with pytest.raises(ValueError, match=r"'model.norm.weight' is \(16,\) torch.bfloat16"):
        fp8({"model.norm.weight": torch.ones(16, dtype=torch.bfloat16)})


def test_the_same_mapping_again_is_quantized_again_without_being_looked_at_again():
    """A trainer passing its mapping every version gets the same dict back (the publisher
    then knows it at once) with the new values quantized; a tensor given new memory, or
    another mapping, is looked at afresh."""
    g = torch.Generator().manual_seed(5)
    proj = "model.layers.0.self_attn.q_proj.weight"
    weights = {
        proj: torch.randn(256, 256, generator=g).bfloat16(),
        "model.norm.weight": torch.ones(256, dtype=torch.bfloat16),
    }
    fp8 = BlockFp8()
    first = fp8(weights)
    weights[proj].mul_(3)  # the next version, in place
    again = fp8(weights)
    assert again is first
    values, scale = quantize_block_fp8(weights[proj])
    assert torch.equal(again[proj].view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(again[scale_name(proj)], scale)
    weights[proj].data = torch.randn(256, 256, generator=g).bfloat16()  # new memory
    moved = fp8(weights)
    assert moved is not first
    values, _ = quantize_block_fp8(weights[proj])
    assert torch.equal(moved[proj].view(torch.uint8), values.view(torch.uint8))
    assert fp8(dict(weights)) is not moved  # another mapping of the same tensors
