"""Publisher ranks in their own processes: data-parallel replicas that each hold a ``TinyNet``
in a shm buffer they allocated (so the sender can map it) and publish it, all with the same
publisher id, as the ranks of one trainer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from tests.support import children
from tests.support.models import TinyNet, step


def offered_copy(tensors: Mapping[str, torch.Tensor]):
    """``tensors`` copied into one shm buffer this process allocated, as a trainer offering
    its memory holds them: the sender maps it and packs every bucket itself. Returns the
    buffer (release it with the shm transport) and the copies by name."""
    from weightsync.buckets import TensorSpec
    from weightsync.transports import shm_tensors

    store, copies = shm_tensors([TensorSpec.of(name, t) for name, t in tensors.items()])
    for name, t in tensors.items():
        copies[name].copy_(t)
    return store, copies


class Published(NamedTuple):
    """What a publisher rank reports after each version."""

    rank: int
    version: int
    sender_packed: bool
    route_bytes: dict[str, int]
    error: str


def _publisher_main(address, publisher_id, rank, world_size, seed, versions, out):
    import weightsync.sender.publisher as publisher_module
    from weightsync.sender import Publisher
    from weightsync.transports import get_transport

    def never(*args):
        raise AssertionError(f"publisher rank {rank} was asked to pack")

    # Replicas offer the same memory: the sender must pack from one copy, never ask a rank.
    publisher_module.pack_entry = never
    trainer = TinyNet(seed)
    store, tensors = offered_copy(trainer.state_dict())
    publisher = Publisher(address, publisher_id=publisher_id, rank=rank, world_size=world_size)
    try:
        for version in versions:
            step(trainer, version)
            for name, t in trainer.state_dict().items():
                tensors[name].copy_(t)
            try:
                status = publisher.publish(tensors, version, wait=True, timeout_s=60).status
                out.put(
                    Published(rank, version, status.sender_packed, dict(status.route_bytes), "")
                )
            except Exception as e:  # reported to the test, which fails on it
                out.put(Published(rank, version, False, {}, f"{type(e).__name__}: {e}"))
                return
    finally:
        publisher.close()
        get_transport("shm").release(store)


def start_publishers(address: str, world_size: int, seed: int, versions: tuple[int, ...]):
    """One process per rank of a trainer of ``world_size`` data-parallel replicas, each
    stepping ``TinyNet(seed)`` with ``step(trainer, version)`` and publishing every version
    (``wait=True``); returns (processes, out queue of ``Published``)."""
    out = children.queue()
    procs = []
    for rank in range(world_size):
        args = (address, "dp-trainer", rank, world_size, seed, versions, out)
        p = children.process(_publisher_main, args, daemon=True)
        p.start()
        procs.append(p)
    return procs, out
