"""The sender's registry: receivers, publishers and versions, and what each receiver owes.

It is the per-receiver state machine of a version (addressed, verdict, bucket acks, applied;
failed or timed out at any point) and the failure bookkeeping that goes with it. Every
mutating method runs with ``cond`` held, the one lock of the sender: the coordinator, the
version driver and the broadcast share it (it is an ``RLock``, so they nest). Waiters
(drivers waiting for a slot or a packed bucket, ``WaitApplied`` callers) wake on it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping

from weightsync import __version__, trace
from weightsync.config import SenderSettings
from weightsync.errors import (
    ConfigError,
    ProtocolError,
    SyncTimeoutError,
    TransportError,
    VersionError,
    WeightSyncError,
)
from weightsync.metrics import SenderMetrics
from weightsync.sender.planner import BROADCAST, MAP
from weightsync.sender.records import (
    APPLIED,
    FAILED,
    PENDING,
    Outcome,
    ReceiverConn,
    RunAborted,
    VersionRun,
)
from weightsync.sender.slots import SlotPool
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import error_to_pb


class Registry:
    """Receivers by id, publishers by id, the last ``history`` versions; ``slots`` learns
    which receivers no longer read (acked, failed, or their version abandoned)."""

    def __init__(
        self,
        cond: threading.Condition,
        settings: SenderSettings,
        metrics: SenderMetrics,
        slots: SlotPool,
        host_id: str,
    ) -> None:
        self._cond, self._settings, self._metrics, self._slots = cond, settings, metrics, slots
        self._host_id = host_id
        """This host's id: a receiver that registers with another is remote."""
        self._receivers: dict[str, ReceiverConn] = {}
        self._publishers: dict[str, pb.PublisherStatus] = {}
        self._runs: OrderedDict[int, VersionRun] = OrderedDict()
        self._last_version = 0
        self.finished: deque[tuple] = deque()
        """Log lines of finished versions (``logging`` arguments), written off the lock."""

    # ---- receivers ----

    def add_receiver(self, hello: pb.ReceiverHello) -> ReceiverConn:
        with self._cond:
            rid = hello.receiver_id or f"{hello.engine or 'receiver'}-{uuid.uuid4().hex[:8]}"
            old = self._receivers.get(rid)
            if old is not None and old.connected:
                raise ConfigError(f"receiver id {rid!r} is already connected; ids must be unique")
            conn = ReceiverConn(
                rid,
                hello.engine,
                hello.rank,
                hello.device,
                tuple(hello.transports),
                remote=bool(hello.host_id) and hello.host_id != self._host_id,
                device_uuid=hello.device_uuid,
            )
            if old is not None:
                conn.applied_version, conn.dirty = old.applied_version, old.dirty
            self._receivers[rid] = conn
            return conn

    def receiver_gone(self, conn: ReceiverConn, why: str) -> None:
        with self._cond:
            if not conn.connected:
                return
            conn.connected = False
            conn.state = "disconnected"
            for run in self._runs.values():
                if run.outcomes.get(conn.receiver_id, Outcome(APPLIED)).state == PENDING:
                    self.fail(run, conn.receiver_id, ProtocolError(f"receiver {why}"))
            conn.outbox.put(None)

    def receiver(self, rid: str) -> ReceiverConn:
        return self._receivers[rid]

    def receivers(self) -> list[ReceiverConn]:
        """Every receiver that ever registered, connected or not (lock held)."""
        return list(self._receivers.values())

    def set_data_paths(self, paths: Mapping[str, str]) -> None:
        for rid, path in paths.items():
            self._receivers[rid].data_path = path

    def broadcast_members(self, run: VersionRun) -> list[str]:
        """The receivers still in ``run`` that get its buckets by broadcast."""
        return [rid for rid in run.active() if self._receivers[rid].data_path == BROADCAST]

    def on_receiver_message(self, conn: ReceiverConn, msg: pb.ReceiverMessage) -> None:
        kind = msg.WhichOneof("kind")
        body = getattr(msg, kind)
        trace.mark(f"sender.{kind}", receiver=conn.receiver_id, index=getattr(body, "index", -1))
        with self._cond:
            run = self._runs.get(body.version)
            outcome = run.outcomes.get(conn.receiver_id) if run else None
            if run is None or outcome is None or outcome.state != PENDING:
                return  # late reply for a version it already left
            timeout = self._settings.ack_timeout_s
            if kind == "verdict":
                outcome.got("verdict", timeout)
                if not body.accepted:
                    # Rejected before any write: it still holds its previous weights.
                    conn.state = "dirty" if conn.dirty else "idle"
                    conn.last_error = body.error.message
                    self.fail(run, conn.receiver_id, body.error, notify=False)
            elif kind == "ack":
                outcome.got(f"bucket:{body.index}", timeout)
                try:
                    self._slots.release_reader(
                        conn.receiver_id, run.version, body.index, body.read_event
                    )
                except TransportError as e:
                    self._fail_dirty(run, conn, error_to_pb(e))
                direct = run.tensors.direct
                if direct is not None and body.index == direct.index:
                    run.direct_readers.discard(conn.receiver_id)
                if not body.ok:
                    self._fail_dirty(run, conn, body.error)
            elif kind == "applied":
                outcome.got("applied", timeout)
                if body.ok:
                    outcome.state, outcome.applied_at = APPLIED, time.time()
                    conn.applied_version, conn.state, conn.last_error = run.version, "idle", ""
                    conn.dirty = False
                    self._metrics.receiver_applied(conn.receiver_id, run.version)
                else:
                    self._fail_dirty(run, conn, body.error)
            self.maybe_complete(run)
            self._cond.notify_all()

    # ---- versions ----

    def publisher_joined(self, status: pb.PublisherStatus) -> None:
        self._publishers[status.publisher_id] = status

    def check_version(self, version: int) -> None:
        if version <= self._last_version:
            raise VersionError(
                f"version {version} is not greater than the last published version "
                f"{self._last_version}; publish {self._last_version + 1} or later"
            )

    def add_run(self, run: VersionRun) -> None:
        """Record a new version (checked by :meth:`check_version`); Status keeps the last
        ``history`` of them."""
        self._last_version = run.version
        self._runs[run.version] = run
        while len(self._runs) > self._settings.history:
            self._runs.popitem(last=False)

    def address(
        self, run: VersionRun, expect: str, message: Callable[[ReceiverConn], pb.Announcement]
    ) -> list[ReceiverConn]:
        """Send every receiver still in ``run`` its ``message``; each owes ``expect`` back."""
        conns = [self._receivers[rid] for rid in run.active()]
        for conn in conns:
            run.outcomes[conn.receiver_id].expect(expect, self._settings.ack_timeout_s)
            conn.send(message(conn))
        return conns

    def open_version(self, run: VersionRun, start: pb.Announcement) -> None:
        """Address ``run`` to every connected receiver; one that cannot open the staging
        transport fails at once."""
        for conn in self._receivers.values():
            if not conn.connected:
                continue
            outcome = run.outcomes[conn.receiver_id] = Outcome()
            if conn.data_path == MAP and conn.transports and run.transport not in conn.transports:
                self.fail(
                    run,
                    conn.receiver_id,
                    TransportError(
                        f"receiver {conn.receiver_id} opens {list(conn.transports)}, "
                        f"the sender stages with {run.transport}"
                    ),
                )
                continue
            outcome.expect("verdict", self._settings.ack_timeout_s)
            conn.state = "applying"
            conn.send(start)

    def run_of(self, version: int) -> VersionRun | None:
        with self._cond:
            return self._runs.get(version)

    @property
    def last_version(self) -> int:
        return self._last_version

    # ---- waiting ----

    def wait(
        self, run: VersionRun, ready: Callable[[], object], timeout_s: float, what: str
    ) -> None:
        """Wait (lock held) until ``ready()``; RunAborted once ``run`` is over."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if run.done:
                raise RunAborted()
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncTimeoutError(
                    f"version {run.version}: waited {timeout_s:.0f} s for {what}"
                )
            self._cond.wait(min(left, 1.0))
        if run.done:
            raise RunAborted()

    def wait_applied(self, version: int, timeout_s: float) -> pb.VersionStatus:
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        with self._cond:
            run = self._runs.get(version)
            if run is None:
                raise VersionError(
                    f"version {version} is unknown to this sender (never published or "
                    f"dropped from its history of {self._settings.history})"
                )
            while not run.done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise SyncTimeoutError(
                        f"version {version} not applied by every receiver within {timeout_s} s; "
                        f"still pending: {run.active()}"
                    )
                self._cond.wait(1.0 if left is None else min(left, 1.0))
            return run.to_pb()

    def expire(self, now: float) -> None:
        """Fail every receiver that owes a reply past its deadline (lock held)."""
        for run in list(self._runs.values()):
            for rid, outcome in list(run.outcomes.items()):
                if outcome.state == PENDING and outcome.deadline and outcome.deadline < now:
                    owed = ", ".join(sorted(outcome.awaiting))
                    self.fail(
                        run,
                        rid,
                        SyncTimeoutError(
                            f"receiver {rid} sent nothing for "
                            f"{self._settings.ack_timeout_s:.0f} s "
                            f"during version {run.version} (owed: {owed})"
                        ),
                    )

    # ---- failure bookkeeping (lock held) ----

    def fail(
        self, run: VersionRun, rid: str, error: BaseException | pb.ErrorDetail, notify: bool = True
    ) -> None:
        """Receiver ``rid`` is out of ``run``; with ``notify``, it is told to abort it."""
        detail = error if isinstance(error, pb.ErrorDetail) else error_to_pb(error)
        outcome = run.outcomes[rid]
        outcome.state, outcome.error = FAILED, detail
        outcome.awaiting, outcome.deadline = set(), None
        conn = self._receivers[rid]
        if conn.state == "applying":
            conn.state = "failed"
        conn.last_error = conn.last_error or detail.message
        self._slots.forget_reader(rid)
        run.direct_readers.discard(rid)
        if notify:
            conn.send(pb.Announcement(abort=pb.VersionAbort(version=run.version, reason=detail)))
        self._metrics.receiver_failed(rid)
        self.maybe_complete(run)
        self._cond.notify_all()

    def _fail_dirty(self, run: VersionRun, conn: ReceiverConn, error: pb.ErrorDetail) -> None:
        """The receiver failed after writing: its weights match no version until the next."""
        conn.state, conn.dirty, conn.last_error = "dirty", True, error.message
        self.fail(run, conn.receiver_id, error, notify=False)

    def abort(self, run: VersionRun, detail: pb.ErrorDetail) -> None:
        """Abandon ``run``: every receiver still in it fails, its publishers get the error."""
        if run.done:
            return
        for rid in run.active():
            self.fail(run, rid, detail)
        self._slots.release_version(run.version)
        for rank in run.ranks.values():
            rank.outbox.put(WeightSyncError(f"version {run.version} abandoned: {detail.message}"))
        run.state = "failed"
        run.complete_s = time.monotonic() - run.started_mono
        self._cond.notify_all()

    def maybe_complete(self, run: VersionRun) -> None:
        """Once staged and no receiver is left owing anything, the version is over."""
        if run.state != "staged" or run.active():
            return
        run.complete_s = time.monotonic() - run.started_mono
        run.state = (
            "complete" if all(o.state == APPLIED for o in run.outcomes.values()) else "failed"
        )
        self._metrics.version_done(run.state, run.complete_s)
        trace.mark("sender.complete", version=run.version)
        if run.notify_done:
            done = pb.SenderReply(done=run.to_pb())
            for rank in run.ranks.values():
                rank.outbox.put(done)
        self.finished.append(_summary(run))

    # ---- status ----

    def status(self) -> pb.StatusReply:
        with self._cond:
            s = self._settings
            return pb.StatusReply(
                sender_version=__version__,
                transport=s.transport,
                bucket_size_bytes=s.bucket_size_bytes,
                num_buffers=s.num_buffers,
                publishers=list(self._publishers.values()),
                receivers=[
                    pb.ReceiverStatus(
                        receiver_id=c.receiver_id,
                        engine=c.engine,
                        rank=c.rank,
                        device=c.device,
                        connected=c.connected,
                        applied_version=c.applied_version,
                        state=c.state,
                        last_error=c.last_error,
                        data_path=c.data_path,
                    )
                    for c in sorted(self._receivers.values(), key=lambda c: c.receiver_id)
                ],
                versions=[run.to_pb() for run in self._runs.values()],
            )

    def close(self) -> None:
        """Abandon unfinished versions and end every receiver's stream."""
        with self._cond:
            for run in self._runs.values():
                if not run.done:
                    self.abort(run, error_to_pb(TransportError("the sender is shutting down")))
            for conn in self._receivers.values():
                conn.outbox.put(None)
            self._cond.notify_all()


def _summary(run: VersionRun) -> tuple:
    applied = sum(o.state == APPLIED for o in run.outcomes.values())
    direct = run.tensors.direct
    return (
        "version %d %s: %.1f MB (%.1f MB direct), %d bucket(s), staged %.3f s, "
        "done %.3f s, applied by %d/%d receiver(s)%s",
        run.version,
        run.state,
        run.manifest.total_bytes / 1e6,
        (direct.nbytes if direct else 0) / 1e6,
        len(run.tensors.staged.buckets),
        run.staged_s,
        run.complete_s,
        applied,
        len(run.outcomes),
        "".join(
            f"; {rid} failed: {o.error.message}"
            for rid, o in run.outcomes.items()
            if o.state == FAILED
        ),
    )
