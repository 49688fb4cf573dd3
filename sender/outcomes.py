"""The per-version outcome state machine: what each receiver owes for a version and what it
did (addressed, verdict, bucket acks, applied; failed or timed out at any point), and the
failure bookkeeping that goes with it.

Every mutating method runs with ``cond`` held, the one lock of the sender: the coordinator,
the version driver and the broadcast share it (it is an ``RLock``, so they nest). Waiters
(drivers waiting for a slot or a packed bucket, ``WaitApplied`` callers) wake on it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from weightsync import trace
from weightsync.config import SenderSettings
from weightsync.errors import ProtocolError, SyncTimeoutError, TransportError, WeightSyncError
from weightsync.metrics import SenderMetrics
from weightsync.sender.history import VersionHistory
from weightsync.sender.planner import MAP
from weightsync.sender.records import Outcome, ReceiverConn, VersionRun
from weightsync.sender.registry import Registry
from weightsync.sender.slots import SlotPool
from weightsync.sender.states import OutcomeState, ReceiverState, VersionState
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import boxes_from_pb, check_boxes, error_to_pb

log = logging.getLogger("weightsync.sender")


class Outcomes:
    """Moves each receiver's :class:`Outcome` through the versions of ``history``; receivers
    are looked up in ``registry``; ``slots`` learns which receivers no longer read (acked,
    failed, or their version abandoned)."""

    def __init__(
        self,
        cond: threading.Condition,
        settings: SenderSettings,
        metrics: SenderMetrics,
        slots: SlotPool,
        registry: Registry,
        history: VersionHistory,
    ) -> None:
        self._cond, self._settings, self._metrics, self._slots = cond, settings, metrics, slots
        self._registry, self._history = registry, history
        self.finished: deque[tuple[VersionRun, str]] = deque()
        """Finished versions (and why one was abandoned), whose log lines the coordinator's
        monitor builds and writes off the lock (:meth:`VersionRun.log_line`): not on the thread
        that sent ``done``, whose next message may be the next version."""

    def receiver_left(self, conn: ReceiverConn, why: str) -> None:
        """Its stream ended (later calls do nothing): it fails in every version it was still
        in."""
        with self._cond:
            was = self._registry.disconnect(conn)
            if was is None:
                return
            failed = []
            for run in self._history.runs():
                if conn.receiver_id in run.active():
                    failed.append(run.version)
                    self.fail(run, conn.receiver_id, ProtocolError(f"receiver {why}"))
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

    def on_receiver_message(self, conn: ReceiverConn, msg: pb.ReceiverMessage) -> None:
        kind = msg.WhichOneof("kind")
        body = getattr(msg, kind)
        trace.mark(f"sender.{kind}", receiver=conn.receiver_id, index=getattr(body, "index", -1))
        with self._cond:
            run = self._history.run_of(body.version)
            outcome = run.outcomes.get(conn.receiver_id) if run else None
            if run is None or outcome is None or outcome.state != OutcomeState.PENDING:
                return  # late reply for a version it already left
            timeout = self._settings.ack_timeout_s
            if kind == "verdict":
                outcome.got("verdict", timeout)
                if body.accepted and not self._declared(run, conn, body):
                    return
                if not body.accepted:
                    # Rejected before any write: it still holds its previous weights.
                    conn.state = ReceiverState.DIRTY if conn.dirty else ReceiverState.IDLE
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
                    outcome.state, outcome.applied_at = OutcomeState.APPLIED, time.time()
                    conn.applied_version, conn.last_error = run.version, ""
                    conn.state = ReceiverState.IDLE
                    conn.dirty = False
                    # It committed: it reads nothing more, whether or not it acked every read
                    # (else the version would wait for it with no deadline left to end that).
                    run.direct_readers.discard(conn.receiver_id)
                    self._metrics.receiver_applied(conn.receiver_id, run.version)
                else:
                    self._fail_dirty(run, conn, body.error)
            self.reads_done(run)
            self.maybe_complete(run)
            self._cond.notify_all()

    # ---- versions ----

    def address(
        self,
        run: VersionRun,
        expect: str,
        message: Callable[[ReceiverConn], pb.Announcement],
        to: Callable[[str], bool] | None = None,
    ) -> list[ReceiverConn]:
        """Send every receiver still in ``run`` (those ``to`` accepts) its ``message``; each
        owes ``expect`` back."""
        conns = [self._registry.receiver(rid) for rid in run.active() if to is None or to(rid)]
        for conn in conns:
            outcome = run.outcomes[conn.receiver_id]
            outcome.expect(expect, self._settings.ack_timeout_s)
            outcome.wrote = outcome.wrote or expect.startswith("bucket:")
            conn.send(message(conn))
        return conns

    @contextmanager
    def together(self) -> Iterator[None]:
        """What is sent to a receiver inside goes out in one message (lock held): a version's
        start, direct bucket and end cost the receiver one stream read, not three. Only to
        receivers that take batches."""
        conns = [c for c in self._registry.receivers() if c.connected and c.batches]
        for conn in conns:
            conn.held = []
        try:
            yield
        finally:
            for conn in conns:
                held, conn.held = conn.held, None
                if held and conn.connected:
                    conn.outbox.put(held)

    def open_version(
        self, run: VersionRun, start: Callable[[ReceiverConn], pb.Announcement]
    ) -> None:
        """Address ``run`` to every connected receiver; one that cannot open the staging
        transport fails at once."""
        for conn in self._registry.receivers():
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
            conn.state = ReceiverState.APPLYING
            conn.send(start(conn))

    def expire(self, now: float) -> None:
        """Fail every receiver that owes a reply past its deadline, and close its stream
        (lock held): a deaf receiver would cost every later version the same wait, one that
        still listens registers again."""
        for run in self._history.runs():
            for rid, outcome in list(run.outcomes.items()):
                if outcome.overdue(now):
                    owed = ", ".join(sorted(outcome.awaiting))
                    error = SyncTimeoutError(
                        f"receiver {rid} sent nothing for {self._settings.ack_timeout_s:.0f} s "
                        f"during version {run.version} (owed: {owed})"
                    )
                    self.fail(run, rid, error)
                    conn = self._registry.receiver(rid)
                    if conn.connected:
                        conn.outbox.put(
                            SyncTimeoutError(f"{error}; its stream is closed: register again")
                        )
                        self.receiver_left(conn, "timed out")

    # ---- failure bookkeeping (lock held) ----

    def fail(
        self, run: VersionRun, rid: str, error: BaseException | pb.ErrorDetail, notify: bool = True
    ) -> None:
        """Receiver ``rid`` is out of ``run``; with ``notify``, it is told to abort it."""
        detail = error if isinstance(error, pb.ErrorDetail) else error_to_pb(error)
        outcome = run.outcomes[rid]
        outcome.state, outcome.error = OutcomeState.FAILED, detail
        outcome.awaiting, outcome.deadline = set(), None
        conn = self._registry.receiver(rid)
        if conn.state == ReceiverState.APPLYING:
            # Told to abort after a bucket (its publisher died, a timeout): it may have
            # written some; its next hello says for sure.
            conn.dirty = conn.dirty or outcome.wrote
            conn.state = ReceiverState.DIRTY if conn.dirty else ReceiverState.FAILED
        conn.last_error = conn.last_error or detail.message
        conn.broadcast_failed = conn.broadcast_failed or detail.code == TransportError.__name__
        self._slots.forget_reader(rid)
        run.direct_readers.discard(rid)
        if notify:
            conn.send(pb.Announcement(abort=pb.VersionAbort(version=run.version, reason=detail)))
        self._metrics.receiver_failed(rid)
        self.reads_done(run)
        self.maybe_complete(run)
        self._cond.notify_all()

    def _declared(self, run: VersionRun, conn: ReceiverConn, verdict: pb.ManifestVerdict) -> bool:
        """Take the boxes an accepting verdict declares (or, ``keeps_same``, the ones it
        declared before on this stream); a malformed one fails the receiver in ``run`` and
        returns False."""
        specs = run.manifest.tensors
        rid = conn.receiver_id
        try:
            if verdict.keeps_same:
                if not conn.keeps_declared:
                    raise ProtocolError(
                        f"{rid} said it keeps the boxes it declared before, but no verdict on "
                        "this stream declared any; upgrade the receiver to the sender's "
                        "weightsync version"
                    )
                boxes = conn.keeps
                if specs is not conn.counted:  # declared for another tensor list
                    check_boxes(boxes, {t.name: t for t in specs}, rid)
            else:
                boxes = {}
                if verdict.keeps:
                    boxes = boxes_from_pb(verdict.keeps, {t.name: t for t in specs}, rid)
                    conn.keeps_declared = True
        except ProtocolError as e:
            self.fail(run, rid, e)
            return False
        conn.declare(boxes, specs)
        return True

    def _fail_dirty(self, run: VersionRun, conn: ReceiverConn, error: pb.ErrorDetail) -> None:
        """The receiver failed after writing: its weights match no version until the next."""
        conn.state, conn.dirty, conn.last_error = ReceiverState.DIRTY, True, error.message
        self.fail(run, conn.receiver_id, error, notify=False)

    def abort(self, run: VersionRun, detail: pb.ErrorDetail) -> None:
        """Abandon ``run``: every receiver still in it fails, its publishers get the error."""
        if run.done:
            return
        staged = run.state == VersionState.STAGED  # then failing its last receivers finishes it
        if not staged:
            run.abandoned = detail  # first: it is abandoned, not ended by its receivers failing
        for rid in run.active():
            self.fail(run, rid, detail)
        self._slots.release_version(run.version)
        for rank in run.ranks.values():
            rank.outbox.put(WeightSyncError(f"version {run.version} abandoned: {detail.message}"))
        if not staged:
            run.state = VersionState.FAILED
            run.complete_s = time.monotonic() - run.started_mono
            self._metrics.version_done(run.state, run.complete_s)
            self._finished(run, detail.message)
        self._cond.notify_all()

    def reads_done(self, run: VersionRun) -> None:
        """``run`` is staged once its driver sent everything and no receiver still reads
        direct tensors (lock held): its publishers hear so (``staged``), and it completes once
        its receivers are done. An abandoned version is not staged."""
        if run.state != VersionState.READING or run.direct_readers or run.abandoned is not None:
            return
        run.staged_s = time.monotonic() - run.started_mono
        run.state = VersionState.STAGED
        run.tell_staged()
        self.maybe_complete(run)
        self._cond.notify_all()

    def maybe_complete(self, run: VersionRun) -> None:
        """Once staged and no receiver is left owing anything, the version is over; once
        every receiver it was addressed to failed, at once (its driver stops packing and
        tells the publishers). Receivers can apply it before its driver staged it (they had
        the end): it completes when staged."""
        if run.active() or run.done:
            return
        if run.state != VersionState.STAGED:
            # A receiver that applied had the end: its driver stages the version next.
            applied = any(o.state == OutcomeState.APPLIED for o in run.outcomes.values())
            if run.outcomes and run.abandoned is None and not applied:
                self._every_receiver_failed(run)
            return
        run.complete_s = time.monotonic() - run.started_mono
        run.state = (
            VersionState.COMPLETE
            if all(o.state == OutcomeState.APPLIED for o in run.outcomes.values())
            else VersionState.FAILED
        )
        trace.mark("sender.complete", version=run.version)
        run.tell_done()
        self._metrics.version_done(run.state, run.complete_s)  # after `done`: off its path
        self._finished(run)

    def _every_receiver_failed(self, run: VersionRun) -> None:
        """``run`` failed before it was staged: nobody is left to read the rest."""
        run.state = VersionState.FAILED
        run.complete_s = time.monotonic() - run.started_mono
        self._slots.release_version(run.version)
        self._metrics.version_done(run.state, run.complete_s)
        trace.mark("sender.complete", version=run.version)
        self._finished(run)
        self._cond.notify_all()

    def _finished(self, run: VersionRun, why: str = "") -> None:
        """``run`` is over: the collector may run again, and its log line is due."""
        if run.gc_hold is not None:
            run.gc_hold.release()
        self.finished.append((run, why))

    def close(self) -> None:
        """Abandon unfinished versions (the sender shuts down)."""
        with self._cond:
            for run in self._history.runs():
                if not run.done:
                    self.abort(run, error_to_pb(TransportError("the sender is shutting down")))
