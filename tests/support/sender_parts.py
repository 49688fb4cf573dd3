"""The sender's bookkeeping parts (registry, version history, what versions share, outcomes)
wired as the coordinator wires them, without sockets or threads, and versions to feed them."""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import NamedTuple

from weightsync.buckets import TensorSpec
from weightsync.config import SenderSettings
from weightsync.manifest import VersionManifest
from weightsync.metrics import SenderMetrics
from weightsync.sender.announcements import open_version
from weightsync.sender.catch_ups import CatchUps
from weightsync.sender.history import VersionHistory
from weightsync.sender.outcomes import Outcomes, Shared
from weightsync.sender.planner import plan_tensors
from weightsync.sender.records import RankConn
from weightsync.sender.registry import Registry
from weightsync.sender.slots import SlotPool
from weightsync.sender.version import Version
from weightsync.v1 import weightsync_pb2 as pb

SETTINGS = SenderSettings(bucket_size_bytes=1024, ack_timeout_s=5)


class SenderParts(NamedTuple):
    cond: threading.Condition
    """The sender's lock: the parts' "lock held" methods are called with it."""
    history: VersionHistory
    registry: Registry
    shared: Shared
    """What the versions made by :func:`new_run` share."""
    outcomes: Outcomes


def sender_parts(slots: SlotPool | None = None) -> SenderParts:
    cond = threading.Condition()
    history = VersionHistory(cond, SETTINGS.history)
    metrics = SenderMetrics()
    registry = Registry(cond, SETTINGS, metrics, history, "here")
    shared = Shared(cond, SETTINGS, metrics, slots or SlotPool(2, 1024), registry, deque())
    outcomes = Outcomes(shared, history, CatchUps(shared, history))
    return SenderParts(cond, history, registry, shared, outcomes)


def new_run(parts: SenderParts, version: int, wait_applied: bool = False) -> Version:
    manifest = VersionManifest(version, (TensorSpec("w", "float32", (64,)),))
    begin = pb.BeginVersion(wait_applied=wait_applied)
    ranks = {0: RankConn(0, "cpu", begin, outbox=queue.Queue())}
    tensors = plan_tensors(manifest, {0: begin}, False, SETTINGS.bucket_size_bytes)
    return Version(
        manifest, tensors, "p", "shm", ranks, shared=parts.shared, notify_done=wait_applied
    )


def published(parts: SenderParts, version: int, wait_applied: bool = False) -> Version:
    """A new version in the history (checked as the coordinator checks it), addressed to
    every connected receiver as the driver starts one."""
    run = new_run(parts, version, wait_applied)
    with parts.cond:
        parts.history.check_version(version)
        parts.history.add_run(run)
        start = pb.Announcement(start=pb.VersionStart())
        open_version(run, lambda _: start)
    return run


DIRECT_SPECS = (TensorSpec("a", "float32", (64,)), TensorSpec("b", "float32", (64,)))
"""The tensors of :func:`direct_run`'s versions: one list for all (a manifest key's versions
share theirs)."""


def direct_run(parts: SenderParts, version: int, **fields) -> Version:
    """Version ``version`` of two tensors its publisher offers whole: nothing is staged, the
    receivers read both in place. ``fields``: more of the version's fields."""
    manifest = VersionManifest(version, DIRECT_SPECS)
    piece = dict(source=0, dtype="float32", size=[64], stride=[1], dst_start=[0])
    begin = pb.BeginVersion(
        wait_applied=True,
        allow_direct=True,
        sources=[pb.BufferHandle(buffer_id="storage", nbytes=4096)],
        pieces=[
            pb.SourcePiece(name="a", offset=0, **piece),
            pb.SourcePiece(name="b", offset=256, **piece),
        ],
    )
    tensors = plan_tensors(manifest, {0: begin}, True, SETTINGS.bucket_size_bytes)
    assert tensors.direct is not None and not tensors.staged.buckets
    ranks = {0: RankConn(0, "cpu", begin, outbox=queue.Queue(), offer=b"offer")}
    return Version(
        manifest, tensors, "p", "shm", ranks, shared=parts.shared, notify_done=True, **fields
    )
