"""One bench run: floors, peer baselines and weightsync cases for one model, same bytes.

The calling process is the trainer: it holds the synthetic shards, embeds the ``Sender`` (so
staging buffers count in its memory) and publishes. Receivers are long-lived worker processes
(spawned), one on the trainer's device and, with two GPUs, one on the other GPU.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.multiprocessing as tmp

from weightsync.app.bench import baselines, floors, hosts, node
from weightsync.app.bench.host import check_memory, machine
from weightsync.app.bench.layout import TrainerLayout, TrainerShards, plan_layout
from weightsync.app.bench.models import hf_specs, model_shape
from weightsync.app.bench.report import (
    BASELINE,
    D2D,
    FLAT,
    FLOOR,
    LOCKSTEP,
    OTHER,
    PER_TENSOR,
    SAME,
    WEIGHTSYNC,
    Report,
    Row,
)
from weightsync.app.bench.worker import (
    CaseReply,
    DropLayout,
    Receive,
    SetLayout,
    Stop,
    WorkerLink,
    memory_extra,
    memory_start,
    sync,
    worker_main,
)
from weightsync.buckets import DEFAULT_BUCKET_SIZE_BYTES, plan_buckets
from weightsync.errors import ConfigError, SyncTimeoutError, TransportError
from weightsync.logs import quieted
from weightsync.manifest import VersionManifest

CASES = ("staged", "direct", "ipc-cross", "nccl")


@dataclass(frozen=True)
class BenchConfig:
    model: str = "qwen2.5-7b"
    layers: int | None = None
    """Cut the model to this many layers (default: all, or what fits for the MoE model)."""
    tps: tuple[int, ...] = (1, 2)
    cases: tuple[str, ...] = CASES
    device: str = "auto"
    """auto (cuda:0 when available), cuda, or cpu (shm instead of cuda_ipc)."""
    versions: int = 5
    """Measured versions per case; the median is reported."""
    warmup: int = 1
    """Versions before measuring (version 1 opens IPC handles and resolves names)."""
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    baselines: bool = True
    floors: bool = True
    sender_process: bool = False
    """The one-GPU cases' sender in a process of its own (``_sender``)."""
    seed: int = 0
    timeout_s: float = 300.0
    gpus: int = 0
    """With N >= 1: also the node case on GPUs 0..N-1 (``node.py``)."""
    engine_tp: int = 1
    """The node case's engine TP size (``gpus`` a multiple of it)."""
    trainer_tps: tuple[int, ...] = (1,)
    """The node case's trainer TP sizes, one node run each (``gpus`` a multiple of each)."""
    hosts: int = 0
    """With N >= 1: also the hosts case on N GPUs as two hosts (``hosts.py``; CPU: two
    receivers)."""

    def __post_init__(self) -> None:
        unknown = set(self.cases) - set(CASES)
        if unknown:
            raise ConfigError(f"unknown case(s) {sorted(unknown)}; known: {', '.join(CASES)}")
        if self.versions < 1 or self.warmup < 0:
            raise ConfigError("--versions must be >= 1 and --warmup >= 0")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"--device {self.device!r}: pick auto, cuda or cpu")
        if self.gpus < 0:
            raise ConfigError(f"--gpus {self.gpus}: give a number of GPUs, or 0 for no node case")
        if self.engine_tp < 1 or (self.gpus and self.gpus % self.engine_tp):
            raise ConfigError(
                f"--engine-tp {self.engine_tp}: give a TP size that divides --gpus {self.gpus}"
            )
        bad = [tp for tp in self.trainer_tps if tp < 1 or (self.gpus and self.gpus % tp)]
        if bad or not self.trainer_tps:
            raise ConfigError(
                f"--trainer-tp {bad[0] if bad else '(none)'}: give TP sizes that divide "
                f"--gpus {self.gpus}"
            )
        if self.hosts and self.hosts % self.engine_tp:
            raise ConfigError(
                f"--engine-tp {self.engine_tp}: give a TP size that divides --hosts {self.hosts}"
            )


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
    sock_dir = tempfile.mkdtemp(prefix="ws-bench-", dir="/tmp")
    try:
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
                    _case(cfg, case, layout, shards, workers, device, gpus, sock_dir)
                )
            workers.broadcast(DropLayout(), cfg.timeout_s)
            del shards
            if cuda:
                torch.cuda.empty_cache()
    finally:
        workers.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
    # After the single-GPU cases: their workers have given back their memory.
    for tp in cfg.trainer_tps if cfg.gpus else ():
        engines = f"TP={cfg.engine_tp} x {cfg.gpus // cfg.engine_tp}"
        console.print(f"node: trainer TP={tp} x DP={cfg.gpus // tp}, engines {engines}")
        node_run = node.measure_node(
            shape,
            cfg.gpus,
            cfg.versions,
            cfg.warmup,
            cfg.versions,
            cfg.timeout_s,
            cfg.engine_tp,
            tp,
        )
        report.rows.extend(node_run.rows())
    if cfg.hosts:
        console.print("hosts: trainer PP=2 over 2 hosts, a sender per host")
        hosts_run = hosts.measure_hosts(
            shape, cfg.hosts if cuda else 0, cfg.versions, cfg.warmup, cfg.timeout_s, cfg.engine_tp
        )
        console.print(hosts.summary(hosts_run))
        report.rows.extend(hosts_run.rows())
    if not cuda:
        notes.append("CPU mode: shm instead of cuda_ipc; direct, cross-GPU and nccl skipped")
    return report


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
                error or _mismatch_note(reply),
                failed=bool(error) or not reply.bit_exact,
            )
        )
    return rows


def _mismatch_note(reply: CaseReply) -> str:
    if not reply.mismatches:
        return ""
    return f"{len(reply.mismatches)} tensor(s) differ, first {reply.mismatches[0]}"


def _skip_reason(case: str, cuda: bool, gpus: int) -> str:

    if case == "direct" and not cuda:
        return "GPU only (a view of CUDA IPC-mapped trainer memory)"
    if case in ("ipc-cross", "nccl") and gpus < 2:
        return "needs 2 GPUs"
    return ""


def _case(
    cfg: BenchConfig,
    case: str,
    layout: TrainerLayout,
    shards: TrainerShards,
    workers: _Workers,
    device: torch.device,
    gpus: int,
    sock_dir: str,
) -> Row:
    from weightsync.sender import Publisher

    cuda = device.type == "cuda"
    transport = {"nccl": "nccl"}.get(case, "cuda_ipc" if cuda else "shm")
    placement = OTHER if case in ("ipc-cross", "nccl") else (SAME if cuda else "cpu")
    name = "staged" if case == "ipc-cross" else case
    row = Row(WEIGHTSYNC, name, transport, layout.name, placement, layout.total_bytes)
    skip = _skip_reason(case, cuda, gpus)
    if skip:
        return replace(row, note=f"skipped: {skip}")
    link = workers.links[placement]
    versions = cfg.warmup + cfg.versions
    start = memory_start(device)
    samples: list[float] = []
    error = ""
    reply: CaseReply | None = None
    try:
        with _sender(
            f"unix:{sock_dir}/{case}-{layout.tp}.sock",
            cfg.bucket_size_bytes,
            transport,
            cfg.sender_process,
        ) as address:
            try:
                link.start(Receive(address, transport, versions, cfg.timeout_s))
                hello = link.expect(cfg.timeout_s, "registration")
                if hello != "registered":
                    raise _CaseFailed()
                with Publisher(address) as publisher:
                    publish = _publish_fn(publisher, case, shards, cfg.timeout_s)
                    for version in range(1, versions + 1):
                        shards.step()
                        sync(device)
                        t0 = time.perf_counter()
                        publish(version)
                        samples.append(time.perf_counter() - t0)
            finally:
                # The receiver leaves before its sender stops: else it sees the stream end,
                # says it lost the sender and registers again.
                reply = link.result(cfg.timeout_s)
    except _CaseFailed:
        pass
    except Exception as e:  # recorded in the row; the run goes on with the next case
        error = f"{type(e).__name__}: {e}"
    extra = memory_extra(device, start)
    if reply is None:  # the sender never started, or the receiver sent no reply
        reply = link.result(cfg.timeout_s)
    error = error or reply.error
    if error:
        return _failed(row, error)
    return replace(
        row,
        samples_s=tuple(samples[cfg.warmup :]),
        trainer_extra_bytes=extra,
        receiver_extra_bytes=reply.extra_memory_bytes,
        bit_exact=reply.bit_exact,
        note=_mismatch_note(reply),
        failed=not reply.bit_exact,
    )


@contextmanager
def _sender(
    address: str, bucket_size_bytes: int, transport: str, own_process: bool
) -> Iterator[str]:
    """A case's sender at ``address``: in this process, or (``own_process``) a
    `weightsync-sender` of its own, as users run it beside a trainer."""
    from weightsync.sender import Sender

    if not own_process:
        with Sender(address, bucket_size_bytes=bucket_size_bytes, transport=transport):
            yield address
        return
    env = {
        **os.environ,
        "WEIGHTSYNC_LISTEN": address,
        "WEIGHTSYNC_BUCKET_SIZE_BYTES": str(bucket_size_bytes),
        "WEIGHTSYNC_TRANSPORT": transport,
    }
    log = Path(address.removeprefix("unix:")).with_suffix(".log")
    with log.open("w") as out:
        # Not the bench's stdout: a sender left behind would hold a pipe reading it open.
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightsync.app.cli", "sender", "--log-level", "warning"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_serving(proc, address, log)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise SyncTimeoutError(
                f"the sender at {address} did not stop within 10 s of SIGTERM (killed); its "
                f"log: {log.read_text()[-2000:]}"
            ) from None


def _wait_serving(proc: subprocess.Popen, address: str, log: Path, timeout_s: float = 60) -> None:
    """Wait until the sender process serves at ``address``; one that exits first (a bad
    setting, the address taken) fails at once, with its log."""
    from weightsync.control.client import connect

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            channel, _ = connect(address, 0.5)
        except TransportError:
            code = proc.poll()
            if code is not None:
                raise TransportError(
                    f"the sender exited with code {code} before it served: "
                    f"{log.read_text()[-2000:].strip()} (its log: {log})"
                ) from None
            if time.monotonic() > deadline:
                raise TransportError(
                    f"the sender did not serve at {address} within {timeout_s:g} s: "
                    f"{log.read_text()[-2000:].strip()} (its log: {log})"
                ) from None
            continue
        channel.close()
        return


class _CaseFailed(Exception):
    """The receiver failed to register; its case reply says why."""


def _failed(row: Row, error: str) -> Row:
    return replace(row, note=error[:300], failed=True)


def _publish_fn(publisher, case: str, shards: TrainerShards, timeout_s: float):
    layout, direct = shards.layout, case == "direct"
    if all(r.is_view for r in layout.recipes):
        views = shards.hf_views()
        return lambda v: publisher.publish(views, v, wait=True, timeout_s=timeout_s, direct=direct)
    # TP > 1: receivers read the shards' pieces in place (direct), else the sender gathers.
    specs, regions = layout.specs, shards.regions()
    return lambda v: publisher.publish_packed(
        VersionManifest(v, specs),
        shards.pack,
        device=shards.device,
        wait=True,
        timeout_s=timeout_s,
        regions=regions,
        direct=direct,
    )
