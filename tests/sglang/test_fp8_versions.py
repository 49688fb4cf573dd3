"""FP8 versions into SGLang's REAL block-FP8 model classes on CPU (issue 36): a trainer's
weights turned into the block-FP8 checkpoint form by ``BlockFp8`` (e4m3 projections, 128 x 128
float32 ``weight_scale_inv``) and driven through ``SglangWeightTarget`` in chunked buckets,
version after version, leave every parameter and buffer bit-identical to the same model class
loaded fresh by SGLang's own loader (``load_weights`` and ``process_weights_after_loading``)
from that version's FP8 checkpoint.

What runs here: SGLang's ``Fp8LinearMethod`` (and ``Fp8MoEMethod``) with
``weight_block_size=[128, 128]`` build fp8 parameters on CPU and load and post-process them on
the generic path (no DeepGEMM runner, no ROCm: post-processing keeps the checkpoint's layout).
SGLang's own CPU engine (``SGLANG_USE_CPU_ENGINE=1``) would instead repack the weights for AMX
(``_amx_process_weight_after_loading``, sgl-kernel's CPU ops, not on PyPI); on Hopper with
DeepGEMM, SGLang requantizes the scales to UE8M0 after loading (publish with
``BlockFp8(ue8m0=True)`` there). Neither runs on this machine. Nothing runs forward.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.sglang import install_cpu_shims

install_cpu_shims()  # before transformers or SGLang import torchvision

from tests.support import drive, manifest_of, random_weights  # noqa: E402
from tests.support.models import tiny_config  # noqa: E402
from tests.support.sglang import checkpoint_specs, init_sglang, sglang_load  # noqa: E402
from tests.sweeps.archs import live_tensors  # noqa: E402
from weightsync.fp8 import FP8, BlockFp8  # noqa: E402

pytestmark = pytest.mark.sglang

BUCKET_BYTES = 64 * 1024  # several buckets per version, the larger tensors chunked
SIZES = {
    "qwen2": dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1),
    "qwen3_moe": dict(
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
    ),
}
"""Tiny configs whose projections split into whole 128 x 128 blocks per packed slice (head_dim
128: q, k and v each whole blocks of qkv_proj; gate and up of 256 / expert 128 rows), as
SGLang's block-FP8 layers require; the embedding and lm_head stay float32."""


def _build(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(sglang_model, hf_model)``: SGLang's class of ``arch`` quantized to block FP8."""
    import transformers
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    init_sglang()
    if arch == "qwen2":
        from sglang.srt.models.qwen2 import Qwen2ForCausalLM as Sgl
    else:
        from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM as Sgl
    config = tiny_config(arch, **SIZES[arch], intermediate_size=256)
    config.dtype = torch.float32
    quant = Fp8Config(
        is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128]
    )
    torch.manual_seed(0)
    return Sgl(config, quant_config=quant), getattr(transformers, config.architectures[0])(config)


def _differing(got: torch.nn.Module, want: torch.nn.Module) -> list[str]:
    """Names whose tensors are not bit-identical (fp8 compared as bytes), or on one side only."""
    a, b = live_tensors(got), live_tensors(want)
    out = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        if x.dtype == FP8 and y.dtype == FP8:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
            out.append(name)
    return out


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_fp8_versions_equal_sglangs_own_load_of_the_fp8_checkpoint(arch):
    from weightsync.receiver.sglang.target import SglangWeightTarget

    model, hf = _build(arch)
    specs = checkpoint_specs(hf)
    target = SglangWeightTarget(model, "cpu")
    quantized = set()
    for version in (1, 2, 3):
        tensors = BlockFp8()(random_weights(specs, seed=version))
        quantized = {n for n, t in tensors.items() if t.dtype == FP8}
        drive(target, manifest_of(version, tensors), tensors, BUCKET_BYTES)
        fresh = sglang_load(_build(arch)[0], tensors)
        wrong = _differing(model, fresh)
        assert not wrong, f"version {version}: {len(wrong)} differ from a fresh load: {wrong[:4]}"
    live_fp8 = [n for n, t in live_tensors(model).items() if t.dtype == FP8]
    assert live_fp8 and len(quantized) >= len(live_fp8)  # packed and fused params take several
