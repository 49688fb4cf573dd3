"""Every transformers causal LM buildable tiny on CPU, as a receiver: the checkpoint
``save_pretrained`` writes, published through ``TorchReceiver``'s target into a model with other
weights, equals bit for bit (every parameter and buffer) ``from_pretrained`` of that checkpoint.

transformers 5 keeps some models in another layout than it saves (fused MoE experts), so this
exercises its own checkpoint conversion inside the receiver.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.support import drive, manifest_of
from tests.sweeps.archs import (
    ARCHS,
    BUCKET_BYTES,
    Arch,
    Skip,
    differing,
    live_tensors,
    receives_like_the_engine,
    save_checkpoint,
    sweep,
    tiny_config,
)
from weightsync.errors import ManifestMismatchError
from weightsync.receiver.torch_receiver import torch_target

TRANSFORMERS_MIN_PASSED = 59


def _other_model(arch: Arch) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)


def check(arch: Arch, tmp: Path) -> None:
    from transformers import AutoModelForCausalLM

    try:
        tensors = save_checkpoint(arch, tmp)
        reference = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        model = _other_model(arch)
    except Exception as e:  # noqa: BLE001
        raise Skip(f"transformers cannot build it: {type(e).__name__}: {e}") from e
    receives_like_the_engine("transformers", torch_target(model), tensors, model, reference)


def test_transformers_sweep():
    report = sweep("transformers", ARCHS, check)
    assert not report.failed, report.summary()
    assert len(report.passed) >= TRANSFORMERS_MIN_PASSED or os.environ.get("WEIGHTSYNC_SWEEP_ONLY")


def test_qwen2_moe_partial_expert_group_rejected_before_any_write(tmp_path):
    """A fused gate_up_proj needs every expert's gate and up: one missing is refused whole."""
    arch = Arch("qwen2_moe")
    tensors = save_checkpoint(arch, tmp_path)
    model = _other_model(arch)
    before = {n: t.clone() for n, t in live_tensors(model).items()}
    partial = {
        n: t for n, t in tensors.items() if n != "model.layers.1.mlp.experts.2.up_proj.weight"
    }
    with pytest.raises(ManifestMismatchError, match=r"layers\.1\.mlp\.experts\.gate_up_proj"):
        drive(torch_target(model), manifest_of(1, partial), partial, BUCKET_BYTES)
    assert not differing(live_tensors(model).items(), before.items())


def test_live_layout_names_still_accepted():
    """A sender publishing the in-memory layout (fused experts) keeps working."""
    model = _other_model(Arch("qwen2_moe"))
    fused = {n: t + 1 for n, t in model.state_dict().items() if "experts.gate_up_proj" in n}
    drive(torch_target(model), manifest_of(1, fused), fused, BUCKET_BYTES)
    state = model.state_dict()
    assert all(torch.equal(state[n], t) for n, t in fused.items())
