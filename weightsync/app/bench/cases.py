"""One weightsync case of a bench run (staged, direct, ipc-cross or nccl) and its row.

The calling process is the trainer: it holds the synthetic shards and publishes every version to
the case's sender, embedded in this process (so staging buffers count in its memory) or, with
``sender_process``, a ``weightsync-sender`` of its own, as users run it beside a trainer. The
receiver is the run's long-lived worker of the case's placement.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from weightsync.app.bench.config import BenchConfig
from weightsync.app.bench.layout import TrainerLayout, TrainerShards
from weightsync.app.bench.report import OTHER, SAME, WEIGHTSYNC, Row
from weightsync.app.bench.worker import (
    CaseReply,
    Receive,
    WorkerLink,
    memory_extra,
    memory_start,
    sync,
)
from weightsync.errors import SyncTimeoutError, TransportError
from weightsync.manifest import VersionManifest
from weightsync.v1 import weightsync_pb2 as pb


def mismatch_note(reply: CaseReply) -> str:
    """A row's note on a reply whose tensors differ from what was sent (else empty)."""
    if not reply.mismatches:
        return ""
    return f"{len(reply.mismatches)} tensor(s) differ, first {reply.mismatches[0]}"


def _skip_reason(case: str, cuda: bool, gpus: int) -> str:
    if case == "direct" and not cuda:
        return "GPU only (a view of CUDA IPC-mapped trainer memory)"
    if case in ("ipc-cross", "nccl") and gpus < 2:
        return "needs 2 GPUs"
    return ""


def measure_case(
    cfg: BenchConfig,
    case: str,
    layout: TrainerLayout,
    shards: TrainerShards,
    links: dict[str, WorkerLink],
    device: torch.device,
    gpus: int,
    sock_dir: str,
) -> Row:
    """One weightsync case of ``cfg`` over ``layout``: its sender at a socket in ``sock_dir``
    publishes ``cfg.warmup + cfg.versions`` versions to the worker of its placement in
    ``links``; the row has the measured ones, or why the case was skipped or failed."""
    from weightsync.sender import Publisher

    cuda = device.type == "cuda"
    transport = {"nccl": "nccl"}.get(case, "cuda_ipc" if cuda else "shm")
    placement = OTHER if case in ("ipc-cross", "nccl") else (SAME if cuda else "cpu")
    name = "staged" if case == "ipc-cross" else case
    row = Row(WEIGHTSYNC, name, transport, layout.name, placement, layout.total_bytes)
    skip = _skip_reason(case, cuda, gpus)
    if skip:
        return replace(row, note=f"skipped: {skip}")
    link = links[placement]
    versions = cfg.warmup + cfg.versions
    start = memory_start(device)
    samples: list[float] = []
    written: tuple[int, ...] = ()
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
                    written = _written(publisher.status(), range(cfg.warmup + 1, versions + 1))
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
        note=mismatch_note(reply),
        failed=not reply.bit_exact,
        written_buckets=written,
    )


def _written(status: pb.StatusReply, measured: range) -> tuple[int, ...]:
    """Of each ``measured`` version the status still holds, the buckets the sender wrote into
    receivers' weights; () when it wrote none."""
    counts = {
        v.version: sum(o.written_buckets for o in v.receivers)
        for v in status.versions
        if v.version in measured
    }
    return tuple(counts[v] for v in sorted(counts)) if any(counts.values()) else ()


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
