"""vLLM model classes built directly (vLLM's model loader under a ``VllmConfig``, over gloo),
not by starting an engine: the sweeps, the Qwen3.5 MTP tests, and engine TP=2 played by two
processes, each one TP rank of the same model.
"""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

import torch

_world = None
"""The vLLM world group this process made (it keeps it while nothing replaces it)."""


def vllm_config(path: Path, load_format: str, tensor_parallel_size: int = 1, **engine_args):
    from vllm.engine.arg_utils import EngineArgs

    _inspect_models_here()
    return EngineArgs(
        model=str(path),
        dtype="float32",
        load_format=load_format,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=128,
        seed=0,
        tensor_parallel_size=tensor_parallel_size,
        # TP > 1 in a config only: these processes are the ranks (no executor is started).
        distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
        **engine_args,
    ).create_engine_config()


def _inspect_models_here() -> None:
    """vLLM inspects a model class in a new Python process (so that importing it cannot start
    CUDA), once per architecture and machine (cached under ``VLLM_CACHE_ROOT``): on a fresh CI
    machine that is a vLLM import per architecture the sweeps load, about 20 s each on the
    2-core box. On the CPU there is no CUDA to keep out, so these tests inspect in process
    (the same inspection, the same cache). Versions without that helper are left as they are."""
    from vllm.model_executor.models import registry

    if hasattr(registry, "_run_in_subprocess"):
        registry._run_in_subprocess = _call


def _call(fn):
    return fn()


def init_distributed(world_size: int = 1, rank: int = 0, store: str | None = None) -> None:
    """vLLM's process-wide groups, this process's own (TP = ``world_size``, gloo).

    In one process (world size 1) an in-process engine of an earlier test module leaves its
    groups (a dense model's lack the expert-parallel one) or destroys them when it is
    collected, so they are replaced once here, after collecting such engines. Ranks of a
    larger world meet at ``store`` (a file path all of them name).
    """
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

    if store is None:
        store = os.path.join(tempfile.mkdtemp(prefix="ws-vllm-models-"), "rendezvous")
    # vLLM's CPU communicator names its shared-memory group after this (the executor sets it).
    os.environ.setdefault("VLLM_DIST_IDENT", os.path.basename(os.path.dirname(store)))
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=world_size,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"file://{store}",
            backend="gloo",
        )
        # Under a config without a model vLLM creates the expert-parallel group too (not for a
        # dense model's config), so dense and MoE models share this process.
        ensure_model_parallel_initialized(world_size, 1)
    _world = ps._WORLD


def load_model(path: Path, load_format: str, tensor_parallel_size: int = 1):
    """vLLM's own model loader: ``dummy`` (random weights) or ``safetensors`` (the checkpoint);
    returns the model and its ``VllmConfig``. The groups must exist (:func:`init_distributed`)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    config = vllm_config(path, load_format, tensor_parallel_size)
    with set_current_vllm_config(config):
        loader = get_model_loader(config.load_config)
        return loader.load_model(vllm_config=config, model_config=config.model_config), config


def kernels_differing(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    """Layers whose CPU GEMM kernel computes otherwise than ``reference``'s.

    vLLM-CPU packs linear and lm_head weights after loading into kernel state that is neither
    a parameter nor a buffer (``layer.cpu_linear`` closes over the packed copy): a layer the
    reload did not process again serves its old weights while its parameters look new. Each
    such layer is run on the same input in both models; the outputs must be bit-identical.
    """
    theirs = dict(reference.named_modules())
    out = []
    gen = torch.Generator().manual_seed(0)
    for name, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        if not hasattr(layer, "cpu_linear") or method is None:
            continue
        width = next(
            getattr(layer, attr)
            for attr in ("input_size_per_partition", "input_size", "embedding_dim")
            if hasattr(layer, attr)
        )
        x = torch.randn(3, width, generator=gen)
        with torch.no_grad():
            got = method.apply(layer, x)
            want = theirs[name].quant_method.apply(theirs[name], x)
        if not torch.equal(got, want):
            out.append(f"{name} (its packed CPU kernel)")
    return out
