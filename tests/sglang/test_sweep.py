"""Every SGLang model class buildable tiny on CPU: the checkpoint transformers writes, published
through ``SglangWeightTarget``, equals bit for bit (every parameter and buffer) a second copy of
the same SGLang class loaded by SGLang's own loader (``load_weights`` and post-processing) from
the same tensors. Most of each version is replayed from the target's bake, and the bake
itself is proven against SGLang's own loaders (``tests.support.replay_proof``).

Lives in tests/sglang, which only the SGLang venv collects (``.venv-sglang/bin/python -m pytest
tests/sglang/test_sweep.py``); the architectures and the comparison are tests/sweeps' own.
SGLang's CPU kernels are not installed (tests/support/sglang.py), so nothing runs forward: the
comparison is of the weights.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import torch

from tests.support.sglang import init_sglang, install_cpu_shims

install_cpu_shims()  # before transformers or SGLang import torchvision

from tests.support.replay_proof import replay_differs  # noqa: E402
from tests.sweeps.archs import (  # noqa: E402
    ARCHS,
    BUCKET_BYTES,
    Arch,
    Skip,
    assert_ranks_pass,
    receives_like_the_engine,
    save_checkpoint,
    sweep,
    sweep_at_tp,
    tiny_config,
    tp2_archs,
)
from weightsync.receiver.name_resolver import live_tensors  # noqa: E402

pytestmark = pytest.mark.sglang

SGLANG_MIN_PASSED = 35
KNOWN = {
    "apertus": "its load_weights reads the xIELU act_fn scalars with .item(), which a meta "
    "tensor cannot answer: the loader dry run refuses them",
    "gpt_oss": "its load_weights reads ahead and copies fused experts without a weight_loader: "
    "the loader dry run cannot see where they land",
}
"""Architectures SGLang builds and loads here but weightsync does not receive yet, and why."""
SENTINEL = -7.0
"""Every parameter of both copies starts here: one the checkpoint leaves alone stays equal."""


def _build(arch: Arch) -> torch.nn.Module:
    init_sglang()  # its CPU shims before SGLang's first import
    from sglang.srt.models.registry import ModelRegistry

    config = tiny_config(arch)
    try:
        cls, _ = ModelRegistry.resolve_model_cls(config.architectures)
    except Exception as e:  # noqa: BLE001
        raise Skip(f"SGLang has no class for {config.architectures}: {e}") from e
    kwargs = {"quant_config": None} if "quant_config" in inspect.signature(cls).parameters else {}
    with torch.device("cpu"):
        model = cls(config=config, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.fill_(SENTINEL)
    return model


def check(arch: Arch, tmp: Path, bucket_bytes: int = BUCKET_BYTES) -> None:
    try:
        tensors = save_checkpoint(arch, tmp)
    except Exception as e:  # noqa: BLE001
        raise Skip(f"transformers cannot build it: {type(e).__name__}: {e}") from e
    _receives(arch, tmp, tensors, bucket_bytes)


def _receives(
    arch: Arch, _path: Path, tensors: dict[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES
) -> None:
    try:
        reference = _build(arch)
        model = _build(arch)
        from sglang.srt.model_loader.loader import DefaultModelLoader

        with torch.no_grad():
            DefaultModelLoader.load_weights_and_postprocess(
                # Clones: some loaders change their input in place (Gemma's norm += 1).
                reference,
                ((n, t.clone()) for n, t in tensors.items()),
                torch.device("cpu"),
            )
    except Skip:
        raise
    except Exception as e:  # noqa: BLE001
        raise Skip(f"SGLang cannot build or load it on CPU: {type(e).__name__}: {e}") from e
    from weightsync.receiver.sglang.target import SglangWeightTarget

    target = SglangWeightTarget(model, "cpu")
    receives_like_the_engine("SGLang", target, tensors, model, reference, bucket_bytes)
    # SGLang processes no unquantized layer here (its AMX kernels are not installed): the
    # version's linear layers were replayed, not loaded by load_weights
    assert any(tensors[name].dim() == 2 for name in target.replayed), sorted(target.replayed)
    differing, _ = replay_differs(model, tensors, live_tensors(model))
    assert not differing, f"a replay differs from SGLang's own loaders: {differing}"


def test_sglang_sweep():
    report = sweep("SGLang", ARCHS, check, KNOWN)
    assert not report.failed, report.summary()
    assert len(report.passed) >= SGLANG_MIN_PASSED or os.environ.get("WEIGHTSYNC_SWEEP_ONLY")


def test_deepseek_fused_q_kv_a_across_buckets(tmp_path):
    """SGLang's DeepSeek loads q_a_proj and kv_a_proj_with_mqa in ONE call (it concatenates
    them); with 4 KiB buckets each arrives chunked in other buckets, and the fused parameter
    must still equal SGLang's own load."""
    deepseek = next(a for a in ARCHS if a.model_type == "deepseek_v3")
    check(deepseek, tmp_path, bucket_bytes=4096)


def test_sglang_sweep_at_engine_tp2(tmp_path):
    """Each TP rank's parameters and buffers equal those SGLang's own loader gives that rank."""
    reports = sweep_at_tp("SGLang", tp2_archs(), tmp_path, init_sglang, _receives, KNOWN)
    assert_ranks_pass(reports, ("qwen3", "gemma", "qwen3_moe"))
