"""The hardware floors for the same bytes, measured in the same run.

- ``d2d copy``: one device-to-device copy of every tensor into a preallocated twin, in one
  process (colocated floor; CUDA events; on CPU a memcpy timed with ``perf_counter``).
- ``broadcast``: one broadcast of all bytes as one buffer from GPU 0 to the other processes,
  one per GPU (two by default: the cross-GPU floor; N for the fan-out case), over a private
  ``torch.distributed`` group on its own file store; gloo on CPU (exercises the code; not a
  floor for anything).
- peer bandwidth (the node case's interconnect floor): the best of torch's copy and
  :mod:`~weightsync.peer_copies` moving 2 GB from one GPU into another, alone.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch

from weightsync.app.bench.children import report


def d2d_copy(src: list[torch.Tensor], dst: list[torch.Tensor], reps: int) -> list[float]:
    """Seconds of each of ``reps`` passes copying every ``src[i]`` into ``dst[i]`` (after one
    warm-up pass)."""
    device = src[0].device
    out = []
    for rep in range(reps + 1):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for s, d in zip(src, dst, strict=True):
                d.copy_(s, non_blocking=True)
            end.record()
            end.synchronize()
            seconds = begin.elapsed_time(end) / 1e3
        else:
            start = time.perf_counter()
            for s, d in zip(src, dst, strict=True):
                d.copy_(s)
            seconds = time.perf_counter() - start
        if rep:
            out.append(seconds)
    return out


def _broadcast_rank(
    rank: int, world: int, store_path: str, nbytes: int, reps: int, out: mp.Queue
) -> None:
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= max(world, 2)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if rank == 0:
            buf.fill_(7)
        times = []
        for rep in range(reps + 1):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dist.broadcast(buf, src=0)
            if cuda:
                torch.cuda.synchronize(device)
            if rep:
                times.append(time.perf_counter() - start)
        out.put((rank, times, device.type))
    finally:
        dist.destroy_process_group()


def broadcast(
    nbytes: int, reps: int, timeout_s: float = 300.0, ranks: int = 2
) -> tuple[list[float], str]:
    """Seconds of each of ``reps`` broadcasts of ``nbytes`` from process 0 (GPU 0) to the
    other ``ranks`` - 1 processes, one per GPU (the slowest rank's time per repetition), and
    the backend used ("nccl" or "gloo")."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ws-bench-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_broadcast_rank, args=(r, ranks, store, nbytes, reps, out), daemon=True
            )
            for r in range(ranks)
        ]
        for p in procs:
            p.start()
        try:
            results = {}
            for _ in procs:
                rank, times, kind = report(
                    out, procs, timeout_s, f"broadcast floor ({ranks} ranks)"
                )
                results[rank] = times
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.terminate()
    per_rep = [max(times) for times in zip(*(results[r] for r in range(ranks)), strict=True)]
    return per_rep, "nccl" if kind == "cuda" else "gloo"


def peer_bytes_per_s(device: torch.device, reps: int, nbytes: int = 2 << 30) -> float:
    """The best of torch's copy and :class:`~weightsync.peer_copies.PeerCopies` moving
    ``nbytes`` from the next GPU into ``device``, alone (median of ``reps``)."""
    from weightsync import peer_copies
    from weightsync.regions import CopyBatch

    peer = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
    src = torch.empty(nbytes, dtype=torch.uint8, device=peer)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ways = [lambda: dst.copy_(src, non_blocking=True)]
    if peer_copies.fits(dst, src):
        ways.append(CopyBatch.of([(dst, src)], reused=True).run)
    best = 0.0
    for copy in ways:
        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize(peer)
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            copy()
            torch.cuda.synchronize(peer)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        best = max(best, nbytes / statistics.median(times[1:]))
    return best
