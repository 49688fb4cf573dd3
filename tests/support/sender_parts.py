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
