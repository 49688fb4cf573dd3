"""Issue 36 on the wire: versions broadcast to a receiver on another host (gloo on CPU, the
code NCCL runs for CUDA staging), in full and as exact deltas (``--delta-mb``), bytes and time.

The versions are one decoder layer of the model's shape taking Adam steps at lr 1e-6 on float32
master weights cast to bf16 (as ``weightsync.app.bench.deltas``), each copied in turn (untimed)
into the same trainer tensors, as a trainer updates its weights in place, and published by a
publisher beside the sender; the receiver is a process of its own with another host id
(``WEIGHTSYNC_HOST_ID``), so every bucket crosses by broadcast. Per version: the bytes the
sender broadcast (``VersionStatus.broadcast_bytes``) and the time from publish to applied
(``publish(wait=True)``), the receiver's tensors checked bit for bit against the trainer's
(SHA-256). The first version of each mode goes in full (nobody holds a base).

Run alone: ``python -m weightsync.app.bench.broadcast_deltas`` (rows, then one JSON line).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from weightsync.app.arguments import bench_alone_parser
from weightsync.app.bench.children import report
from weightsync.app.bench.deltas import BETAS, EPS, GRAD_STD, LR, WEIGHT_STD, layer_specs
from weightsync.app.bench.engine_like import EngineLikeModel, EngineLikeTarget
from weightsync.app.bench.models import model_shape
from weightsync.buckets import TensorSpec


@dataclass(frozen=True)
class WireRow:
    """One version as broadcast."""

    mode: str
    version: int
    staged_bytes: int
    broadcast_bytes: int
    delta_buckets: int
    seconds: float
    bit_exact: bool

    @classmethod
    def of(cls, mode: str, status, seconds: float, bit_exact: bool) -> WireRow:
        """The row of the version ``status`` (a ``pb.VersionStatus``) reports."""
        return cls(
            mode,
            status.version,
            status.staged_bytes,
            status.broadcast_bytes,
            status.delta_buckets,
            seconds,
            bit_exact,
        )


def adam_chain(specs: Sequence[TensorSpec], steps: int, seed: int = 0) -> list[dict]:
    """``steps + 1`` consecutive bf16 versions of every tensor (one Adam step apart)."""
    g = torch.Generator().manual_seed(seed)
    chain: list[dict] = [{} for _ in range(steps + 1)]
    for spec in specs:
        master = torch.randn(spec.shape, generator=g) * WEIGHT_STD
        if spec.name.endswith("norm.weight"):
            master += 1.0
        param = torch.nn.Parameter(master)
        opt = torch.optim.Adam([param], lr=LR, betas=BETAS, eps=EPS)
        for step in range(steps + 1):
            chain[step][spec.name] = param.detach().bfloat16()
            param.grad = torch.randn(spec.shape, generator=g) * GRAD_STD
            opt.step()
    return chain


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for n, t in tensors.items()
    }


def _receiver(address: str, model: str, names, syncs: int, env: dict, ready, out) -> None:
    """An engine-like receiver of one layer of ``model`` (``env``: another host id)."""
    os.environ.update(env)
    from weightsync.receiver.core import ReceiverCore

    target = EngineLikeTarget(EngineLikeModel(model_shape(model, 1), torch.device("cpu")))
    receiver = ReceiverCore(target, address, receiver_id="remote", engine="bench")
    ready.put(("ready",))
    for _ in range(syncs):
        version = receiver.sync(timeout=600)
        out.put(("applied", version, digest({n: target.resolve(n) for n in names})))
    receiver.close()


def run_mode(
    mode: str, chain: list[dict], model: str, bucket_mb: int, delta_mb: int
) -> list[WireRow]:
    """Publish every version of ``chain`` to one remote receiver; one row per version."""
    from weightsync.sender import Publisher
    from weightsync.sender.daemon import Sender

    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    env = {"WEIGHTSYNC_HOST_ID": "another-host", "WEIGHTSYNC_RECEIVER_DELTA_BYTES": "0"}
    if delta_mb:
        env["WEIGHTSYNC_RECEIVER_DELTA_BYTES"] = str(delta_mb << 20)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ws-") as d:
        address = f"unix:{d}/s.sock"
        with Sender(address, bucket_size_bytes=bucket_mb << 20, delta_bytes=delta_mb << 20):
            proc = ctx.Process(
                target=_receiver,
                args=(address, model, list(chain[0]), len(chain), env, ready, out),
                daemon=True,
            )
            proc.start()
            report(ready, [proc], 120, "deltas bench")
            publisher = Publisher(address)
            # A trainer updates its weights in place: each version is copied (untimed) into
            # the same tensors, so the sender sees the memory of the last version again.
            live = {n: t.clone() for n, t in chain[0].items()}
            for version, tensors in enumerate(chain, start=1):
                for name, t in tensors.items():
                    live[name].copy_(t)
                start = time.perf_counter()
                publisher.publish(live, version, wait=True, timeout_s=600)
                seconds = time.perf_counter() - start
                _, applied, got = report(out, [proc], 600, "deltas bench")
                status = [s for s in publisher.status().versions if s.version == version][-1]
                exact = applied == version and got == digest(tensors)
                rows.append(WireRow.of(mode, status, seconds, exact))
                print(summary(rows[-1]), flush=True)
            proc.join(60)
    return rows


def summary(row: WireRow) -> str:
    return (
        f"{row.mode} version {row.version}: {row.broadcast_bytes / 1e6:.2f} MB broadcast of "
        f"{row.staged_bytes / 1e6:.1f} MB ({row.broadcast_bytes / row.staged_bytes:.4f}x, "
        f"{row.delta_buckets} bucket(s) as deltas), {row.seconds * 1e3:.0f} ms publish to "
        f"applied; bit-exact {row.bit_exact}"
    )


def both_modes(model: str, steps: int, bucket_mb: int, delta_mb: int) -> list[WireRow]:
    """One layer's ``steps`` + 1 Adam versions published in full, then as deltas."""
    chain = adam_chain(layer_specs(model_shape(model, 1)), steps)
    rows = run_mode("full", chain, model, bucket_mb, 0)
    return rows + run_mode("deltas", chain, model, bucket_mb, delta_mb)


def medians(rows: Sequence[WireRow]) -> tuple[dict, dict, dict]:
    """Per mode: its versions after the first (the first goes full in both), and their median
    bytes broadcast and seconds."""
    later = {m: [r for r in rows if r.mode == m and r.version > 1] for m in ("full", "deltas")}
    sent = {m: int(statistics.median(r.broadcast_bytes for r in rs)) for m, rs in later.items()}
    seconds = {m: statistics.median(r.seconds for r in rs) for m, rs in later.items()}
    return later, sent, seconds


def measure(model: str, steps: int, bucket_size_bytes: int, delta_mb: int = 1024) -> list:
    """The report's rows: versions 2.. of ``steps`` + 1 in full and as deltas, their seconds,
    the median bytes broadcast, and the issue's targets (both under a quarter) in the note."""
    from weightsync.app.bench.report import WEIGHTSYNC, Row

    rows = both_modes(model, steps, max(1, bucket_size_bytes >> 20), delta_mb)
    later, sent, seconds = medians(rows)
    bytes_x, time_x = sent["deltas"] / sent["full"], seconds["deltas"] / seconds["full"]
    note = f"{bytes_x:.4f}x the bytes, {time_x:.2f}x the time of full (targets: both < 0.25)"
    return [
        Row(
            WEIGHTSYNC,
            mode,
            "broadcast",
            "1 layer, Adam lr 1e-6",
            "another host",
            sent[mode],
            tuple(r.seconds for r in rs),
            bit_exact=all(r.bit_exact for r in rs),
            note=note if mode == "deltas" else "",
            failed=not all(r.bit_exact for r in rs),
        )  # fmt: skip
        for mode, rs in later.items()
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = bench_alone_parser(__doc__)
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--steps", type=int, default=4, help="versions after the first")
    p.add_argument("--bucket-size-mb", type=int, default=64)
    p.add_argument("--delta-mb", type=int, default=1024)
    p.add_argument("--gpus", type=int, default=0, help="NCCL from GPU 0 to GPUs 1..N-1")
    p.add_argument("--layers", type=int, default=None, help="with --gpus: default all")
    p.add_argument("--changed", type=float, nargs="*", default=[], help="--gpus: not Adam")
    args = p.parse_args(argv)
    if args.gpus:
        return _main_gpu(args)
    rows = both_modes(args.model, args.steps, args.bucket_size_mb, args.delta_mb)
    _, sent, med = medians(rows)
    print(
        f"versions 2-{args.steps + 1}, median: deltas {sent['deltas'] / sent['full']:.4f}x the "
        f"bytes, {med['deltas'] / med['full']:.3f}x the time ({med['deltas'] * 1e3:.0f} vs "
        f"{med['full'] * 1e3:.0f} ms)",
        flush=True,
    )
    print(json.dumps([asdict(r) for r in rows]))
    return 0 if all(r.bit_exact for r in rows) else 1


def _main_gpu(args: argparse.Namespace) -> int:
    """The Adam chain of the model (or ``--layers`` of it), or each ``--changed`` fraction's
    synthetic chain, over NCCL; a medians line per chain, then one JSON line of every row."""
    from weightsync.app.bench import broadcast_deltas_gpu as gpu

    model, layers, out = args.model, args.layers, {}
    steps = gpu.fitting_steps(model, layers, args.steps, args.delta_mb)
    for changed in args.changed or [None]:
        what = gpu.describe(model, layers, changed, args.gpus)
        print(f"{what}: {steps} version(s) after the first", flush=True)
        rows = gpu.both_modes_gpu(
            model, layers, steps, args.gpus, args.bucket_size_mb, args.delta_mb, changed
        )
        print(gpu.medians_line(rows, what), flush=True)
        out[what] = rows
    print(json.dumps({w: [asdict(r) for r in rows] for w, rows in out.items()}))
    return 0 if all(r.bit_exact for rows in out.values() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
