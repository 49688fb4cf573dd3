"""SglangWeightTarget against SGLang 0.5's REAL model classes built on CPU (TP=1, gloo).

Every live parameter is compared bit-exactly with a reference packed by hand from the same HF
tensors (tests/support/sglang.py), packed qkv / gate_up slices and fused experts included.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import drive, manifest_of, random_weights
from tests.support.sglang import build, checkpoint_specs, expected_live
from weightsync.errors import ManifestMismatchError, NameResolutionError
from weightsync.manifest import LoraAdapterSpec

pytestmark = pytest.mark.sglang

BUCKET_BYTES = 64 * 1024  # several buckets per version, some tensors chunked across buckets


def _target(model, **kwargs):
    from weightsync.receiver.sglang.target import SglangWeightTarget

    return SglangWeightTarget(model, "cpu", **kwargs)


def assert_live_equals(model: torch.nn.Module, checkpoint: dict[str, torch.Tensor]) -> None:
    expected = expected_live(checkpoint)
    live = dict(model.named_parameters())
    assert sorted(live) == sorted(expected)
    for name, param in live.items():
        assert torch.equal(param.data, expected[name]), name


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3_moe"])
def arch(request):
    return request.param


def test_three_versions_bit_exact(arch):
    model, hf = build(arch)
    specs = checkpoint_specs(hf)
    target = _target(model)
    for version in (1, 2, 3):
        tensors = random_weights(specs, seed=version)
        loads = drive(target, manifest_of(version, tensors), tensors, BUCKET_BYTES)
        assert loads >= 3
        assert_live_equals(model, tensors)


def test_partial_update_changes_only_what_was_sent(arch):
    model, hf = build(arch)
    specs = checkpoint_specs(hf)
    full = random_weights(specs, seed=1)
    target = _target(model)
    drive(target, manifest_of(1, full), full, BUCKET_BYTES)
    # One slice of a packed qkv, one of a packed gate_up or of a fused expert, a norm.
    wanted = [
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.mlp.experts.2.up_proj.weight"
        if arch == "qwen3_moe"
        else "model.layers.0.mlp.gate_proj.weight",
        "model.norm.weight",
    ]
    fresh = random_weights([s for s in specs if s.name in wanted], seed=2)
    drive(target, manifest_of(2, fresh), fresh, BUCKET_BYTES)
    assert_live_equals(model, {**full, **fresh})


def test_lora_accumulated_across_buckets_and_loaded_once():
    model, hf = build("qwen2")
    specs = checkpoint_specs(hf)

    class RecordingLoader:
        """Stands in for SGLang's LoRA manager, which needs a running server (GPU)."""

        def __init__(self):
            self.calls = []

        def validate(self, spec):
            pass

        def load(self, spec, tensors, version):
            self.calls.append((spec.name, {n: t.clone() for n, t in tensors.items()}, version))

    loader = RecordingLoader()
    target = _target(model, lora_loader=loader)
    prefix = "base_model.model.model.layers"
    lora = {}
    for layer in (0, 1):
        for proj, out_features in (("q_proj", 128), ("v_proj", 64)):
            lora[f"{prefix}.{layer}.self_attn.{proj}.lora_A.weight"] = torch.randn(8, 128)
            lora[f"{prefix}.{layer}.self_attn.{proj}.lora_B.weight"] = torch.randn(out_features, 8)
    config = json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    for version in (1, 2):
        base = random_weights(specs, seed=version)
        # Half the adapter first, half last: it spans the first and the final bucket.
        names = list(lora)
        ordered = {**{n: lora[n] for n in names[:4]}, **base, **{n: lora[n] for n in names[4:]}}
        spec = LoraAdapterSpec("policy", config, tuple(names))
        loads = drive(target, manifest_of(version, ordered, spec), ordered, BUCKET_BYTES)
        assert loads >= 2
        assert_live_equals(model, base)
        assert len(loader.calls) == version  # once per version, after the last bucket
        name, got, got_version = loader.calls[-1]
        assert (name, got_version) == ("policy", version)
        assert sorted(got) == sorted(lora)
        for n, t in lora.items():
            assert torch.equal(got[n], t), n  # copied out before the buffer was reused
        lora = {n: t + 1 for n, t in lora.items()}


def test_unknown_name_rejected_before_any_write():
    model, hf = build("qwen2")
    target = _target(model)
    good = random_weights(checkpoint_specs(hf), seed=3)
    drive(target, manifest_of(1, good), good, BUCKET_BYTES)
    bad = {
        **random_weights(checkpoint_specs(hf), seed=4),
        "model.layers.0.self_attn.qkv_proj_typo.weight": torch.zeros(4),
    }
    with pytest.raises(NameResolutionError, match="qkv_proj_typo"):
        target.validate(manifest_of(2, bad))
    assert_live_equals(model, good)


@pytest.mark.parametrize(
    "name, bad",
    [
        ("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 128)),  # packed slice
        ("model.layers.0.mlp.down_proj.weight", torch.zeros(128, 256, dtype=torch.bfloat16)),
    ],
)
def test_shape_or_dtype_mismatch_names_the_tensor(name, bad):
    model, hf = build("qwen2")
    tensors = random_weights(checkpoint_specs(hf), seed=4)
    tensors[name] = bad
    with pytest.raises(ManifestMismatchError, match=name.replace(".", r"\.")):
        _target(model).validate(manifest_of(1, tensors))


def test_wrong_expert_shape_rejected():
    model, hf = build("qwen3_moe")
    tensors = random_weights(checkpoint_specs(hf), seed=5)
    tensors["model.layers.1.mlp.experts.3.down_proj.weight"] = torch.zeros(128, 32)
    with pytest.raises(ManifestMismatchError, match=r"experts\.3\.down_proj"):
        _target(model).validate(manifest_of(1, tensors))


def test_lora_without_loader_rejected():
    model, hf = build("qwen2")
    tensors = random_weights(checkpoint_specs(hf), seed=6)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[name] = torch.zeros(8, 128)
    spec = LoraAdapterSpec("policy", "{}", (name,))
    with pytest.raises(ManifestMismatchError, match="no LoRA loader"):
        _target(model).validate(manifest_of(1, tensors, spec))
