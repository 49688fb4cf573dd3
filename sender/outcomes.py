"""What spans a sender's versions: the parts every version shares (:class:`Shared`), and the
receivers' replies and failures as they reach across versions (:class:`Outcomes`): each reply
goes to its version, which takes it from there (``version.py``); a receiver that leaves or owes
a reply past its deadline fails in every version it is still in; the boxes a receiver keeps are
declared once per stream (:func:`declare_keeps`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from weightsync import trace
from weightsync.buckets import TensorSpec
from weightsync.config import SenderSettings
from weightsync.errors import ProtocolError, SyncTimeoutError, TransportError
from weightsync.metrics import SenderMetrics
from weightsync.sender.history import VersionHistory
from weightsync.sender.records import ReceiverConn
from weightsync.sender.registry import Registry
from weightsync.sender.slots import SlotPool
from weightsync.sender.writes import map_offer
from weightsync.topology_model import Box
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import boxes_from_pb, check_boxes, error_to_pb

if TYPE_CHECKING:
    from weightsync.sender.catch_ups import CatchUps
    from weightsync.sender.version import Version

log = logging.getLogger("weightsync.sender")


class Shared(NamedTuple):
    """What every version of one sender shares (the coordinator makes it)."""

    cond: threading.Condition
    """The sender's one lock, an ``RLock`` condition (the coordinator, the driver, the
    broadcast and the versions nest under it); waiters (a driver waiting for a slot or a
    packed bucket, ``WaitApplied``) wake on it."""
    settings: SenderSettings
    metrics: SenderMetrics
    slots: SlotPool
    """The staging slots: they learn which receivers no longer read them."""
    registry: Registry
    finished: deque[tuple[Version, str]]
    """Versions over (and why one was abandoned), whose log lines the coordinator's monitor
    writes off the lock: not on the thread that sent ``done``, whose next message may be the
    next version."""


class Outcomes:
    """Takes each receiver's replies to the versions of ``history`` and to its catch-up, and
    fails it in every one it leaves."""

    def __init__(self, shared: Shared, history: VersionHistory, catch_ups: CatchUps) -> None:
        self._shared, self._history, self._catch_ups = shared, history, catch_ups

    def _runs(self) -> list[Version]:
        return [*self._history.runs(), *self._catch_ups.runs()]

    def on_receiver_message(self, conn: ReceiverConn, msg: pb.ReceiverMessage) -> None:
        """A reply to the version it names; one for a version no longer kept changes
        nothing. A reply to a version sent ahead of its plan waits for its start."""
        kind = msg.WhichOneof("kind")
        body = getattr(msg, kind)
        trace.mark(f"sender.{kind}", receiver=conn.receiver_id, index=getattr(body, "index", -1))
        if kind == "offer":  # mapped off the lock; its verdict comes after it on this stream
            conn.write_offers.keep(body.key, map_offer(body, conn.receiver_id))
            return
        with self._shared.cond:
            if kind == "exported":
                self._catch_ups.exported(conn, body)
                return
            if conn.presented:  # sent ahead of its plan (``armed.py``): wait till it expects this
                timeout_s = self._shared.settings.ack_timeout_s
                if not self._shared.cond.wait_for(lambda: not conn.presented, timeout_s):
                    log.warning(
                        "receiver %s: its %s of version %d came before the version's start, "
                        "which did not come within %.0f s; it is dropped",
                        conn.receiver_id,
                        kind,
                        body.version,
                        timeout_s,
                    )
                    return
            version = self._catch_ups.run_for(conn.receiver_id, body.version)
            version = version or self._history.run_of(body.version)
            if version is None:
                return
            if kind == "verdict":
                version.on_verdict(conn, body)
            elif kind == "ack":
                version.on_ack(conn, body)
            elif kind == "applied":
                for ack in body.acks:  # acks held back for this message (limits: checked)
                    version.on_ack(conn, ack)
                version.on_applied(conn, body)

    def receiver_left(self, conn: ReceiverConn, why: str) -> None:
        """Its stream ended (later calls do nothing): it fails in every version it was still
        in."""
        with self._shared.cond:
            was = self._shared.registry.disconnect(conn)
            if was is None:
                return
            self._catch_ups.source_left(conn)
            failed = []
            for version in self._runs():
                if conn.receiver_id in version.active():
                    failed.append(version.version)
                    version.fail(conn.receiver_id, ProtocolError(f"receiver {why}"))
        log.info(
            "receiver %s left (%s): applied version %d, was %s%s",
            conn.receiver_id,
            why,
            conn.applied_version,
            was,
            f"; failed in version(s) {', '.join(map(str, failed))}" if failed else "",
            extra={
                "event": "receiver_left",
                "receiver_id": conn.receiver_id,
                "reason": why,
                "applied_version": conn.applied_version,
                "state": was,
                "failed_versions": failed,
            },
        )

    def expire(self, now: float) -> None:
        """Fail every receiver that owes a reply past its deadline, and close its stream
        (lock held): a deaf receiver would cost every later version the same wait, one that
        still listens registers again."""
        timeout_s = self._shared.settings.ack_timeout_s
        for version in self._runs():
            for rid, outcome in list(version.outcomes.items()):
                if outcome.overdue(now):
                    owed = ", ".join(sorted(outcome.awaiting))
                    error = SyncTimeoutError(
                        f"receiver {rid} sent nothing for {timeout_s:.0f} s "
                        f"during version {version.version} (owed: {owed})"
                    )
                    version.fail(rid, error)
                    conn = self._shared.registry.receiver(rid)
                    if conn.connected:
                        conn.outbox.put(
                            SyncTimeoutError(f"{error}; its stream is closed: register again")
                        )
                        self.receiver_left(conn, "timed out")

    def close(self) -> None:
        """Abandon unfinished versions (the sender shuts down)."""
        with self._shared.cond:
            for version in self._runs():
                if not version.done:
                    version.abort(error_to_pb(TransportError("the sender is shutting down")))


def declare_keeps(
    conn: ReceiverConn, verdict: pb.ManifestVerdict, specs: Sequence[TensorSpec]
) -> None:
    """Take the boxes an accepting verdict declares for the tensors ``specs``: those it lists
    (kept under its ``keeps_key``), or those its key alone stands for.

    Raises:
        ProtocolError: the verdict is malformed, or names a key this stream never sent boxes
            with (nothing is taken).
    """
    rid = conn.receiver_id
    boxes: Mapping[str, Box] = {}
    if verdict.keeps:
        boxes = boxes_from_pb(verdict.keeps, {t.name: t for t in specs}, rid)
        if verdict.keeps_key:
            conn.keeps_by_key.keep(verdict.keeps_key, (boxes, specs))
    elif verdict.keeps_key:
        what = f"{rid}'s verdict on version {verdict.version}"
        boxes, checked = conn.keeps_by_key.held(verdict.keeps_key, what)
        if specs is not checked:  # declared for another tensor list
            check_boxes(boxes, {t.name: t for t in specs}, rid)
    conn.declare(boxes, specs)
