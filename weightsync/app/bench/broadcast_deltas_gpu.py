"""Issue 36 on GPUs: versions broadcast over NCCL from GPU 0 to a receiver on each of GPUs
1..N-1 of this host, in full and as exact deltas, bytes and time (``broadcast_deltas --gpus``).

The trainer (this process) holds every version of the model's shape on GPU 0, each a flat
buffer whose views are the HF tensors: the Adam chain of ``broadcast_deltas`` made on GPU 0
(float32 masters at lr 1e-6, cast to bf16), or a synthetic chain (a fraction of the bf16 values
moved by one step per version, at random places). It copies each in turn (untimed) into the
trainer's own flat buffer, as a trainer updates its weights in place, and publishes that
buffer's views to a ``Sender(transport="nccl")`` embedded here (staging on GPU 0,
``delta_bytes`` for the deltas mode); a ``TorchReceiver`` process on each other GPU holds a
module whose parameters are views of one flat buffer, deltas on through
``WEIGHTSYNC_RECEIVER_DELTA_BYTES``. Per version: the bytes the sender broadcast
(``VersionStatus.broadcast_bytes``, each group once) and the trainer's wall time of
``publish(wait=True)`` (publish to every receiver applied). After each version, untimed, every
receiver compares its flat buffer with that version's (mapped from GPU 0 by CUDA IPC) bit for
bit.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from weightsync.app.bench.broadcast_deltas import WireRow, medians, summary
from weightsync.app.bench.children import children, expect, reporting, scratch_dir
from weightsync.app.bench.deltas import BETAS, EPS, GRAD_STD, LR, WEIGHT_STD
from weightsync.app.bench.fanout import _offsets, _views
from weightsync.app.bench.models import hf_specs, model_shape
from weightsync.errors import ConfigError

WHAT = "deltas bench"
COMPARE_BYTES = 1 << 28
"""The chunk a receiver copies from GPU 0 to compare (bounds its extra memory)."""


def gpu_chain(specs, steps: int, changed: float | None, device: torch.device, seed: int = 0):
    """``steps + 1`` versions as flat uint8 buffers on ``device`` (one tensor's Adam state at a
    time), each element of ``specs`` at its ``_offsets`` place; ``changed``: the synthetic
    chain's fraction of values moved per version instead of Adam steps."""
    offsets, total = _offsets(specs)
    chain = [torch.zeros(total, dtype=torch.uint8, device=device) for _ in range(steps + 1)]
    views = [_views(flat, specs, offsets) for flat in chain]
    g = torch.Generator(device).manual_seed(seed)
    for spec in specs:
        master = torch.randn(spec.shape, generator=g, device=device) * WEIGHT_STD
        if spec.name.endswith("norm.weight"):
            master += 1.0
        if changed is not None:
            views[0][spec.name].copy_(master)
            for step in range(1, steps + 1):
                moved = views[step][spec.name]
                moved.copy_(views[step - 1][spec.name])
                bits = moved.view(-1).view(torch.int16)
                count = round(changed * bits.numel())
                bits[torch.randperm(bits.numel(), generator=g, device=device)[:count]] += 1
            continue
        param = torch.nn.Parameter(master)
        opt = torch.optim.Adam([param], lr=LR, betas=BETAS, eps=EPS)
        for step in range(steps + 1):
            views[step][spec.name].copy_(param.detach())
            param.grad = torch.randn(spec.shape, generator=g, device=device) * GRAD_STD
            opt.step()
        del param, opt
    return chain, views


def _receiver(model: str, layers, rank: int, address: str, chain, delta_bytes: int, out) -> None:
    os.environ["WEIGHTSYNC_RECEIVER_DELTA_BYTES"] = str(delta_bytes)
    from weightsync.receiver.torch_receiver import TorchReceiver

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    specs = hf_specs(model_shape(model, layers))
    offsets, total = _offsets(specs)
    flat = torch.zeros(total, dtype=torch.uint8, device=device)
    module = torch.nn.Module()
    for name, view in _views(flat, specs, offsets).items():
        *path, leaf = name.split(".")
        owner = module
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(view, requires_grad=False))
    receiver = TorchReceiver(module, address, receiver_id=f"gpu{rank}")
    out.put(("ready", rank, ""))
    try:
        for _ in chain:
            version = receiver.sync(timeout=300)
            want = chain[version - 1]
            same = all(
                torch.equal(flat[i : i + COMPARE_BYTES], want[i : i + COMPARE_BYTES].to(device))
                for i in range(0, total, COMPARE_BYTES)
            )
            out.put(("applied", rank, "" if same else f"version {version} differs on GPU {rank}"))
    finally:
        receiver.close()


def run_mode_gpu(
    mode: str,
    model: str,
    layers: int | None,
    chain: list[torch.Tensor],
    specs,
    gpus: int,
    bucket_mb: int,
    delta_mb: int,
) -> list[WireRow]:
    """Publish every version of ``chain`` from GPU 0 to receivers on GPUs 1..``gpus``-1."""
    import torch.multiprocessing as tmp

    from weightsync.sender import Publisher, Sender

    ctx = tmp.get_context("spawn")
    out = ctx.Queue()
    delta_bytes = delta_mb << 20
    rows = []
    with scratch_dir("ws-deltas-") as sock_dir:
        with (
            Sender(
                f"unix:{sock_dir}/s.sock",
                transport="nccl",
                bucket_size_bytes=bucket_mb << 20,
                delta_bytes=delta_bytes,
                ack_timeout_s=300,
            ) as sender,
            children() as procs,
        ):
            for r in range(1, gpus):
                args = (model, layers, r, sender.address, chain, delta_bytes, out)
                what = f"receiver on GPU {r}"
                procs.append(
                    ctx.Process(target=reporting, args=(what, _receiver, *args), daemon=True)
                )
                procs[-1].start()
            expect(out, procs, "ready", gpus - 1, 300, WHAT)
            live, tensors = _trainer(chain, specs)
            with Publisher(sender.address) as publisher:
                for version, flat in enumerate(chain, start=1):
                    live.copy_(flat)
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    result = publisher.publish(tensors, version, wait=True, timeout_s=300)
                    seconds = time.perf_counter() - start
                    wrong = [
                        w for _, _, w in expect(out, procs, "applied", gpus - 1, 300, WHAT) if w
                    ]
                    status = result.status
                    rows.append(WireRow.of(mode, status, seconds, not wrong))
                    print(summary(rows[-1]), *wrong, flush=True)
    return rows


def _trainer(chain: list[torch.Tensor], specs) -> tuple[torch.Tensor, dict]:
    """The trainer's weights: one more flat buffer, laid out as each version's. A trainer
    updates its weights in place, so each version is copied into it (untimed) and the sender
    sees the memory of the last version again (its plans and mappings kept)."""
    live = torch.empty_like(chain[0])
    return live, _views(live, specs, _offsets(specs)[0])


def both_modes_gpu(
    model: str,
    layers: int | None,
    steps: int,
    gpus: int,
    bucket_mb: int,
    delta_mb: int,
    changed: float | None = None,
) -> list[WireRow]:
    """The chain published in full, then as deltas, GPU 0 to GPUs 1..``gpus``-1.

    Raises:
        ConfigError: fewer than 2 GPUs asked for, or more than the machine has.
    """
    if not 2 <= gpus <= torch.cuda.device_count():
        raise ConfigError(
            f"--gpus {gpus}: needs 2 or more GPUs, this machine has {torch.cuda.device_count()}"
        )
    specs = hf_specs(model_shape(model, layers))
    chain, _ = gpu_chain(specs, steps, changed, torch.device("cuda", 0))
    rows = run_mode_gpu("full", model, layers, chain, specs, gpus, bucket_mb, 0)
    return rows + run_mode_gpu("deltas", model, layers, chain, specs, gpus, bucket_mb, delta_mb)


def fitting_steps(model: str, layers: int | None, steps: int, delta_mb: int) -> int:
    """The most versions after the first, up to ``steps``, whose chain fits GPU 0 beside the
    trainer's weights, the sender's kept bytes (``delta_mb``) and 8 GiB for staging and the
    Adam state."""
    nbytes = _offsets(hf_specs(model_shape(model, layers)))[1]
    free = torch.cuda.mem_get_info(0)[0] - min(delta_mb << 20, nbytes) - (8 << 30)
    return max(1, min(steps, free // nbytes - 2))


def describe(model: str, layers: int | None, changed: float | None, gpus: int) -> str:
    what = "Adam lr 1e-6" if changed is None else f"{changed:g} of values moved"
    size = "whole model" if layers is None else f"{layers} layer(s)"
    return f"{model} {size}, {what}, NCCL GPU 0 -> GPUs 1..{gpus - 1}"


def medians_line(rows: Sequence[WireRow], what: str) -> str:
    _, sent, med = medians(rows)
    return (
        f"{what}: versions 2-{max(r.version for r in rows)}, median: deltas "
        f"{sent['deltas'] / sent['full']:.4f}x the bytes ({sent['deltas'] / 1e6:.1f} of "
        f"{sent['full'] / 1e6:.1f} MB), {med['deltas'] / med['full']:.3f}x the time "
        f"({med['deltas'] * 1e3:.1f} vs {med['full'] * 1e3:.1f} ms)"
    )
