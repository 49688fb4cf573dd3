"""The peers' update patterns, minimally, as baselines measured in the same run.

Trainer side here; the receiving side is in :mod:`weightsync.app.bench.worker`. All three load
through the same :class:`~weightsync.app.bench.engine_like.EngineLikeTarget` as weightsync does,
and their source is the HF tensors as separate allocations (the way an HF-model trainer holds
them; peers gather Megatron shards into such tensors first, which is not timed here).

- ``per-tensor IPC``: every version, one IPC handle per tensor is sent; the receiver opens
  each, copies into its parameters and drops them (vLLM's RLHF colocate example, SGLang's
  per-tensor ``update_weights_from_tensor``).
- ``lockstep bucket``: one 512 MiB bucket, mapped once: pack, hand over, receiver copies out
  and acks, repeat (verl's IPC path).
- ``ping-pong buckets``: the same with two buckets, packing bucket i+1 while i is loaded.

On CPU, "IPC" is shared memory passed by file descriptor (``torch.multiprocessing``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from weightsync.app.bench.worker import BucketBaseline, PerTensorBaseline, WorkerLink, sync
from weightsync.buckets import BucketPlan, pack_entry
from weightsync.errors import ProtocolError


def per_tensor(
    link: WorkerLink,
    tensors: dict[str, torch.Tensor],
    refresh: Callable[[], None],
    warmup: int,
    versions: int,
    timeout_s: float,
) -> list[float]:
    """Seconds per version (all versions); ``refresh`` changes the tensors between versions."""
    device = next(iter(tensors.values())).device
    link.start(PerTensorBaseline(warmup + versions))
    link.expect(timeout_s, "ready")
    items = list(tensors.items())
    out = []
    for _ in range(warmup + versions):
        refresh()
        sync(device)
        start = time.perf_counter()
        link.send(items)
        if link.expect(timeout_s, "ack") != "ack":
            raise ProtocolError("per-tensor baseline: the receiver answered out of order")
        out.append(time.perf_counter() - start)
    return out


def buckets(
    link: WorkerLink,
    tensors: dict[str, torch.Tensor],
    refresh: Callable[[], None],
    plan: BucketPlan,
    num_buffers: int,
    warmup: int,
    versions: int,
    timeout_s: float,
) -> list[float]:
    """Seconds per version of ``num_buffers`` buckets handed over in turn (1: lockstep)."""
    device = next(iter(tensors.values())).device
    buffers = [
        torch.empty(plan.bucket_size_bytes, dtype=torch.uint8, device=device)
        for _ in range(num_buffers)
    ]
    if device.type == "cpu":
        for b in buffers:
            b.share_memory_()
    link.start(BucketBaseline(buffers, plan, warmup + versions))
    link.expect(timeout_s, "ready")
    out = []
    for _ in range(warmup + versions):
        refresh()
        sync(device)
        start = time.perf_counter()
        acked = 0
        for bucket in plan.buckets:
            if bucket.index >= num_buffers:
                # The buffer of bucket index - num_buffers is reused: wait for its ack.
                _ack(link, acked, timeout_s)
                acked += 1
            buffer = buffers[bucket.index % num_buffers]
            for entry in bucket.entries:
                pack_entry(buffer, entry, tensors[entry.name])
            sync(device)
            link.send((bucket.index, bucket.index % num_buffers))
        while acked < len(plan.buckets):
            _ack(link, acked, timeout_s)
            acked += 1
        out.append(time.perf_counter() - start)
    return out


def _ack(link: WorkerLink, index: int, timeout_s: float) -> None:
    got = link.expect(timeout_s, f"ack of bucket {index}")
    if got != index:
        raise ProtocolError(f"bucket baseline: expected the ack of bucket {index}, got {got!r}")
