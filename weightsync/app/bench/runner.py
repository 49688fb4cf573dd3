"""One bench run: floors, peer baselines and weightsync cases for one model, same bytes.

The calling process is the trainer: it holds the synthetic shards and publishes (each weightsync
case: :mod:`.cases`). Receivers are long-lived worker processes (spawned), one on the trainer's
device and, with two GPUs, one on the other GPU. After them, the node, hosts and fan-out
cases (:mod:`.node`, :mod:`.hosts`, :mod:`.fanout`) run on workers of their own.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.multiprocessing as tmp

from weightsync.app.bench import baselines, broadcast_deltas, fanout, floors, fp8, hosts, node
from weightsync.app.bench.awake import awake_state
from weightsync.app.bench.cases import measure_case, mismatch_note
from weightsync.app.bench.children import scratch_dir
from weightsync.app.bench.config import BenchConfig
from weightsync.app.bench.host import check_memory, machine
from weightsync.app.bench.layout import TrainerShards, plan_layout
from weightsync.app.bench.models import hf_specs, model_shape
from weightsync.app.bench.mps import mps_state
from weightsync.app.bench.report import (
    BASELINE,
    D2D,
    FLAT,
    FLOOR,
    LOCKSTEP,
    OTHER,
    PER_TENSOR,
    SAME,
    Report,
    Row,
)
from weightsync.app.bench.worker import (
    DropLayout,
    SetLayout,
    Stop,
    WorkerLink,
    memory_extra,
    memory_start,
    worker_main,
)
from weightsync.buckets import plan_buckets
from weightsync.errors import ConfigError
from weightsync.logs import quieted


class _Workers:
    """The receiver processes, by placement, started once per run."""

    def __init__(self, shape, placements: dict[str, str], timeout_s: float) -> None:
        ctx = tmp.get_context("spawn")
        self.links: dict[str, WorkerLink] = {}
        for placement, device in placements.items():
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(theirs, shape, device), daemon=True)
            proc.start()
            self.links[placement] = WorkerLink(mine, proc)
        for placement, link in self.links.items():
            link.expect(timeout_s, f"start-up on {placements[placement]}")

    def broadcast(self, cmd, timeout_s: float) -> None:
        for link in self.links.values():
            link.send(cmd)
        for link in self.links.values():
            link.expect(timeout_s, type(cmd).__name__)

    def close(self) -> None:
        for link in self.links.values():
            if link.process.is_alive():
                link.send(Stop())
        for link in self.links.values():
            link.process.join(30)
            if link.process.is_alive():
                link.process.terminate()


@quieted("weightsync.sender")
def run(cfg: BenchConfig, console) -> Report:
    """Run every floor, baseline and case of ``cfg``; returns the report (rows in run order).

    The embedded sender's per-version log lines are silenced while it runs: the report is the
    output, and rendering them would compete with the measured versions for the GIL."""
    return _run(cfg, console)


def _run(cfg: BenchConfig, console) -> Report:
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but CUDA is not available here; use --device cpu")
    device = torch.device("cuda:0" if cuda else "cpu")
    gpus = torch.cuda.device_count() if cuda else 0
    shape = model_shape(cfg.model, cfg.layers)
    specs = hf_specs(shape)
    nbytes = sum(s.nbytes for s in specs)
    model_note = (
        f"{shape.layers} of {shape.full_layers} layers, cut to fit memory (--layers N)"
        if shape.full_layers
        else "all layers"
    )
    report = Report(
        {
            "model": shape.name,
            "model_note": model_note,
            "moe": shape.is_moe,
            "layers": shape.layers,
            "tensors": len(specs),
            "bytes": nbytes,
            "gb": nbytes / 1e9,
            "bucket_size_bytes": cfg.bucket_size_bytes,
            "versions": cfg.versions,
            "warmup": cfg.warmup,
            "device": str(device),
            "gpus": gpus,
            "machine": machine(device),
            "mps": mps_state(),
            "awake_cpus": awake_state(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "memory_measure": "torch.cuda.max_memory_allocated delta per process (IPC-mapped "
            "memory counts in the process that allocated it)",
            "notes": [],
        }
    )
    notes: list[str] = report.meta["notes"]
    if shape.full_layers:
        console.print(f"[yellow]{shape.name}: {model_note}[/yellow]")
    if cuda:
        check_memory(nbytes, cfg.bucket_size_bytes)
    placements = {SAME if cuda else "cpu": str(device)}
    if gpus >= 2 and {"ipc-cross", "nccl"} & set(cfg.cases):
        placements[OTHER] = "cuda:1"
    console.print(f"starting receivers on {', '.join(placements.values())}")
    workers = _Workers(shape, placements, cfg.timeout_s)
    try:
        with scratch_dir("ws-bench-") as sock_dir:
            if cfg.floors:
                report.rows.append(_broadcast_floor(cfg, nbytes, cuda, gpus))
            for tp in cfg.tps:
                layout = plan_layout(shape, tp)
                console.print(f"{layout.name}: {len(layout.shards)} shards on {device}")
                shards = TrainerShards.allocate(layout, device, cfg.seed)
                workers.broadcast(SetLayout(tp, shards.flats), cfg.timeout_s)
                if tp == 1 and (cfg.floors or cfg.baselines):
                    report.rows.extend(_floor_and_baselines(cfg, shards, workers, console))
                for case in cfg.cases:
                    console.print(f"{layout.name}: {case}")
                    report.rows.append(
                        measure_case(
                            cfg, case, layout, shards, workers.links, device, gpus, sock_dir
                        )
                    )
                workers.broadcast(DropLayout(), cfg.timeout_s)
                del shards
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        workers.close()
    # After the single-GPU cases: their workers have given back their memory.
    for tp in cfg.trainer_tps if cfg.gpus else ():
        report.rows.extend(_node_rows(cfg, shape, tp, cuda, console))
    if cfg.hosts:
        console.print("hosts: trainer PP=2 over 2 hosts, a sender per host")
        hosts_run = hosts.measure_hosts(
            shape, cfg.hosts if cuda else 0, cfg.versions, cfg.warmup, cfg.timeout_s, cfg.engine_tp
        )
        console.print(hosts.summary(hosts_run))
        report.rows.extend(hosts_run.rows())
    if cfg.fanout:
        console.print(f"fan-out: GPU 0 -> a receiver on each of GPUs 0..{cfg.fanout - 1}, nccl")
        fanout_run = fanout.measure_fanout(
            shape, cfg.fanout, cfg.versions, cfg.warmup, cfg.timeout_s, cfg.bucket_size_bytes
        )
        console.print(fanout.summary(fanout_run))
        report.rows.extend(fanout_run.rows())
    if cfg.fp8:
        console.print("fp8: the versions in bf16, then quantized to block FP8 by the trainer")
        fp8_run = fp8.measure_fp8(
            shape, device, cfg.versions, cfg.warmup, cfg.timeout_s, cfg.bucket_size_bytes
        )
        console.print(fp8.summary(fp8_run))
        report.rows.extend(fp8_run.rows())
    if cfg.deltas:
        console.print("deltas: one layer's Adam steps to another host, in full and as deltas")
        report.rows.extend(broadcast_deltas.measure(cfg.model, cfg.versions, cfg.bucket_size_bytes))
    if not cuda:
        notes.append(
            "CPU mode: shm instead of cuda_ipc; direct, cross-GPU and nccl skipped; the node "
            "case's processes on the CPU, staged through shm"
        )
    return report


def _node_rows(cfg: BenchConfig, shape, tp: int, cuda: bool, console) -> list[Row]:
    """The node case of trainer TP ``tp``, synthetic and (``--megatron``) megatron-core; on
    the CPU its process logic over shm, no node's timing."""
    layout = f"TP={tp} x DP={cfg.gpus // tp}, engines TP={cfg.engine_tp} x "
    console.print(f"node: trainer {layout}{cfg.gpus // cfg.engine_tp}")
    args = (shape, cfg.gpus, cfg.versions, cfg.warmup)
    run = node.measure_node(
        *args, cfg.versions, cfg.timeout_s, cfg.engine_tp, tp, devices=None if cuda else 0
    )
    rows = run.rows()
    if cfg.megatron:
        from weightsync.app.bench.megatron_node import measure_megatron_node

        console.print(f"node: megatron-core trainer {layout}{cfg.gpus // cfg.engine_tp}")
        megatron = measure_megatron_node(
            *args, cfg.timeout_s, cfg.engine_tp, tp, cfg.megatron_ep, cpu=not cuda
        )
        if megatron.layout != run.layout:  # EP: floor rows of its own routes
            megatron = megatron.held_to(run)
        rows.extend(megatron.rows())
    return rows


def _broadcast_floor(cfg: BenchConfig, nbytes: int, cuda: bool, gpus: int) -> Row:
    if cuda and gpus < 2:
        return Row(FLOOR, "broadcast", "nccl", "one buffer", OTHER, nbytes, note="needs 2 GPUs")
    # On CPU: gloo over a tiny model, to exercise the code; it is no floor for anything.
    placement = OTHER if cuda else "cpu"
    backend = "nccl" if cuda else "gloo"
    try:
        samples, backend = floors.broadcast(nbytes, cfg.versions, cfg.timeout_s)
    except Exception as e:  # recorded in the row; the run goes on without this floor
        error = f"{type(e).__name__}: {e}"
        return Row(
            FLOOR, "broadcast", backend, "one buffer", placement, nbytes, note=error, failed=True
        )
    return Row(FLOOR, "broadcast", backend, "one buffer", placement, nbytes, tuple(samples))


def _floor_and_baselines(cfg: BenchConfig, shards: TrainerShards, workers: _Workers, console):
    device = shards.device
    placement = SAME if device.type == "cuda" else "cpu"
    views = shards.hf_views()
    nbytes = shards.layout.total_bytes
    copies = {n: v.clone() for n, v in views.items()}  # separate allocations, as an HF model
    rows = []
    if cfg.floors:
        samples = floors.d2d_copy(list(views.values()), list(copies.values()), cfg.versions)
        rows.append(Row(FLOOR, D2D, "-", "HF tensors", placement, nbytes, tuple(samples)))
        twins = [flat.clone() for flat in shards.flats]
        samples = floors.d2d_copy(shards.flats, twins, cfg.versions)
        del twins
        rows.append(Row(FLOOR, FLAT, "-", "one buffer", placement, nbytes, tuple(samples)))
    if not cfg.baselines:
        return rows
    link = workers.links[placement]
    transport = "cuda_ipc" if device.type == "cuda" else "shm"

    def refresh() -> None:
        shards.step()
        for name, view in views.items():
            copies[name].copy_(view, non_blocking=True)

    plan = plan_buckets(shards.layout.specs, cfg.bucket_size_bytes)
    runs: list[tuple[str, Callable[[], list[float]]]] = [
        (
            PER_TENSOR,
            lambda: baselines.per_tensor(
                link, copies, refresh, cfg.warmup, cfg.versions, cfg.timeout_s
            ),
        ),
    ]
    for name, k in ((LOCKSTEP, 1), ("ping-pong buckets", 2)):
        runs.append(
            (
                name,
                lambda k=k: baselines.buckets(
                    link, copies, refresh, plan, k, cfg.warmup, cfg.versions, cfg.timeout_s
                ),
            )
        )
    for name, measure in runs:
        console.print(f"baseline: {name}")
        start = memory_start(device)
        try:
            samples = measure()[cfg.warmup :]
            error = ""
        except Exception as e:  # recorded in the row; the run goes on with the next case
            samples, error = [], f"{type(e).__name__}: {e}"
        extra = memory_extra(device, start)
        reply = link.result(cfg.timeout_s)
        error = error or reply.error
        rows.append(
            Row(
                BASELINE,
                name,
                transport,
                "HF tensors",
                placement,
                nbytes,
                tuple(samples) if not error else (),
                extra,
                reply.extra_memory_bytes,
                reply.bit_exact if not error else None,
                error or mismatch_note(reply),
                failed=bool(error) or not reply.bit_exact,
            )
        )
    return rows
