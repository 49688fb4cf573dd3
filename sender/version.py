"""A version as the sender runs it, from its plan to every receiver's outcome.

:meth:`Version.run` holds the sender's steps in order, on the driver's thread: start (address
it to the receivers), then per bucket: claim a staging slot, pack, queue its checksum, announce
(and broadcast); then the end; then, once no receiver reads the publishers' memory, staged.
The receivers' replies arrive on their streams' threads (:meth:`~Version.on_verdict`,
:meth:`~Version.on_ack`, :meth:`~Version.on_applied`) and move it on. A receiver fails alone
(:meth:`~Version.fail`); the version fails whole when abandoned (:meth:`~Version.abort`) or
when every receiver failed. A catch-up (``catch_ups.py``) is a version too.

Nothing waits for the GPU per bucket: packing, checksums, broadcasts and the receivers' reads
are ordered by streams and interprocess events; the version waits once, at its end. The steps
take the sender's lock (``Shared.cond``) for what they change; replies and transitions are
called with it held.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from weightsync import gc_pause, trace
from weightsync.errors import ProtocolError, TransportError, WeightSyncError
from weightsync.manifest import VersionManifest
from weightsync.regions import Region
from weightsync.sender.announcements import (
    Send,
    address,
    direct_buckets,
    end_message,
    open_version,
    packed_bucket,
    sends,
    starts,
)
from weightsync.sender.direct_reads import DirectRead
from weightsync.sender.outcomes import Shared, declare_keeps
from weightsync.sender.planner import BROADCAST, MAP, TensorPlan
from weightsync.sender.publisher_packs import PublisherPacks
from weightsync.sender.records import Outcome, RankConn, ReceiverConn, RunAborted
from weightsync.sender.reports import release_publishers, take_owed, tell_done, tell_staged
from weightsync.sender.slots import Slot
from weightsync.sender.states import OutcomeState, VersionState
from weightsync.sender.writes import Writes
from weightsync.transports.broadcast import Encoded, Members, WireCount
from weightsync.transports.broadcast.slices import SliceGroup
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import error_to_pb

if TYPE_CHECKING:
    from weightsync.sender.catch_ups import Retained
    from weightsync.sender.driver import VersionDriver


@dataclass
class Version:
    """One published version: how it travels, its publisher ranks, each receiver's outcome."""

    manifest: VersionManifest
    tensors: TensorPlan
    """How its tensors travel: staged buckets, the direct bucket, their wire layouts."""
    publisher_id: str
    transport: str
    ranks: dict[int, RankConn]
    shared: Shared = field(kw_only=True, repr=False, compare=False)
    regions: Mapping[str, Sequence[Region]] | None = None
    """The publishers' memory mapped here: set when the sender packs every bucket itself."""
    notify_done: bool = False
    """A publisher waits on its stream for every receiver's outcome."""
    direct_reads: Mapping[str, DirectRead] = field(default_factory=dict)
    """Each receiver's own direct bucket, from its nearest copies (as planned)."""
    route_bytes: Mapping[str, int] = field(default_factory=dict)
    """Bytes the receivers take by each route (``planner.ROUTES``), as planned."""
    slices: tuple[SliceGroup, ...] = ()
    """Broadcast receivers that get buckets of their boxes, not the staged ones (``slices.py``)."""
    manifest_key: bytes = b""
    """An id of the manifest without its version (``VersionStart.manifest_key``)."""
    direct_readers: set[str] = field(default_factory=set)
    """Receivers still copying the direct tensors out of the publishers' memory."""
    sums: dict[int, object] = field(default_factory=dict)
    """Each staged bucket's checksum reduction, queued behind its packing (finished at end)."""
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    started_mono: float = field(default_factory=time.monotonic)  # its last rank joined
    plan_s: float = 0.0
    staged_s: float = 0.0
    complete_s: float = 0.0
    state: VersionState = VersionState.PACKING
    abandoned: pb.ErrorDetail | None = None
    """Why the version was abandoned, when it was (Status shows it)."""
    gc_hold: gc_pause.Hold | None = field(default=None, repr=False, compare=False)
    """The garbage collector's pause from planning to the version's end (``gc_pause``)."""
    audience: frozenset[str] | None = None
    """The receivers it is addressed to (a catch-up's late receiver); None: every one."""
    expect_checksums: Sequence[int] = ()
    """A catch-up of the buckets as published: the checksums its source's bytes must have."""
    checksums: Sequence[int] = ()
    """Every bucket's checksum, as its end sent them (``end_message``)."""
    retained: Retained | None = field(default=None, repr=False, compare=False)
    """Its staged buckets copied to host memory as packed (``--retain-mb``)."""
    wire: WireCount = field(default_factory=WireCount)
    writes: Writes = field(default_factory=Writes)
    """The receivers whose weights the sender writes itself, and what it wrote (``writes.py``)."""

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def done(self) -> bool:
        return self.state in (VersionState.COMPLETE, VersionState.FAILED)

    def active(self) -> list[str]:
        """Receivers still taking part (not failed, not yet applied)."""
        return [rid for rid, o in self.outcomes.items() if o.state == OutcomeState.PENDING]

    @cached_property
    def sliced(self) -> frozenset[str]:
        """The receivers in a slice group (they get its buckets, not the staged ones)."""
        return frozenset(rid for g in self.slices for rid in g.members)

    # ---- the sender's steps, on the driver's thread ----

    def run(
        self, driver: VersionDriver, device: torch.device, start: Callable[[], list[Send]]
    ) -> None:
        """Send the version, staged on ``device``, from its start to staged (``start``
        addresses it to the receivers, or returns what an earlier :meth:`start` made). The
        version ends here when it is abandoned or fails: its publishers hear at once."""
        cond, slots = self.shared.cond, self.shared.slots
        packs = PublisherPacks(self, cond, driver.stamp_places) if self.regions is None else None
        issued: deque[tuple[Send, Slot]] = deque()
        try:
            todo = deque(start())
            ended = not todo  # then the end went with the start
            driver.broadcast.connect(self)
            while issued or todo:
                # Every free slot gets a bucket at once: packing never waits for announcements.
                driver.claim_slots(self, issued, todo, packs)
                send, slot = issued[0]
                wrote: frozenset[str] = frozenset()
                if packs is None:
                    driver.before_reuse(slot, device, on_stream=device.type == "cuda")
                    sums, wrote = self.writes.pack(self, send.bucket, slot, send.group is None)
                elif packs.packed_or_slot_free(send.bucket, todo, slots):
                    sums = None
                else:
                    continue  # a slot freed first: it gets the next bucket
                issued.popleft()
                driver.packed(self, send.bucket, slot, device, sums)
                if self.retained is not None and send.group is None:
                    self.retained.keep(send.bucket.index, slot.buffer.tensor[: send.bucket.nbytes])
                delta = driver.broadcast.encode(self, send.group, send.bucket, send.layout, slot)
                members = self._announce(driver, slot, send, delta, wrote)
                if members:
                    driver.broadcast.send(self, slot, send.bucket.nbytes, members, delta)
            if not ended:
                driver.drain(device)
                with cond:
                    self._send_end()
            self._all_sent()
        except RunAborted:
            if self.abandoned is None:
                release_publishers(self, issued, device, packs)
        except WeightSyncError as e:
            with cond:
                self.abort(error_to_pb(e))
        finally:
            with cond:
                slots.stop_packing()
                cond.notify_all()

    def start(self, driver: VersionDriver, device: torch.device) -> list[Send]:
        """Address the version to the receivers: its start, the direct bucket if it has one,
        and its end if it stages nothing, to each receiver in one message; returns the buckets
        to stage (they depend on whom it was addressed to)."""
        with self.shared.cond:
            if self.done:
                # Abandoned while it queued behind another version (its publisher gave up
                # or left): announcing it would leave receivers inside a version that never
                # ends, failing the next one.
                raise RunAborted()
            driver.ensure_slots(self, device)
            with self.shared.registry.together():
                open_version(self, starts(self))
                driver.broadcast.invite(self, device)
                trace.mark("sender.start", version=self.version)
                direct = self.tensors.direct
                if direct is not None:
                    readers = address(self, f"bucket:{direct.index}", direct_buckets(self))
                    self.direct_readers.update(c.receiver_id for c in readers)
                    trace.mark("sender.direct_announced", version=self.version)
                todo = sends(self)
                if not todo:
                    self._send_end()
                self.shared.cond.notify_all()  # replies that waited for it (``armed.py``)
            self.shared.metrics.version_started(self.version)
            return todo

    def _announce(
        self,
        driver: VersionDriver,
        slot: Slot,
        send: Send,
        delta: Encoded | None,
        wrote: frozenset[str],
    ) -> Members:
        """Announce a packed bucket (``delta``: as such to broadcast; ``wrote``: to these
        receivers as written into their weights); its broadcast group or ()."""
        index = send.layout.index
        with self.shared.cond:
            if self.done:
                raise RunAborted()
            group = send.group
            # A slice group's buckets go to its members, the staged ones to the rest.
            members = group.members if group else driver.broadcast.staged_members(self)
            to = set(members).__contains__ if group else lambda rid: rid not in self.sliced
            group_id = driver.broadcast.group_id(members)
            message = packed_bucket(self, send.layout, slot, group_id, delta, wrote)
            conns = address(self, f"bucket:{index}", message, to)
            readers = {c.receiver_id for c in conns if c.data_path == MAP} - wrote
            slot.announced(self.version, index, readers)
            trace.mark("sender.announce", index=index)
            self.shared.metrics.bucket_announced(send.layout.nbytes)
            self.shared.cond.notify_all()
            return members if any(c.data_path == BROADCAST for c in conns) else ()

    def _send_end(self) -> None:
        """Every receiver still in the version gets the end; each owes ``applied`` back."""
        end = end_message(self)
        for rid, error in self.writes.differ(self):
            self.fail(rid, error)
        address(self, "applied", lambda _: end)

    def _all_sent(self) -> None:
        """Every bucket and the end are sent: staged once no receiver still reads direct
        tensors from the publishers' memory; the last such read's ack (or its receiver's
        failure) stages it where it arrives (waking the driver for it cost latency)."""
        with self.shared.cond:
            if self.done:
                raise RunAborted()
            self.state = VersionState.READING
            self.reads_done()

    # ---- the receivers' replies ----

    def on_verdict(self, conn: ReceiverConn, verdict: pb.ManifestVerdict) -> None:
        """It takes part, declaring the boxes it keeps, or rejected it before any write."""
        if self._owed(conn, "verdict") is None:
            return
        if not verdict.accepted:
            self._failed(conn, verdict.error, wrote=False)
        else:
            try:
                declare_keeps(conn, verdict, self.manifest.tensors)
            except ProtocolError as e:
                self.fail(conn.receiver_id, e)
                return
            self.writes.grant(self, conn, verdict)
        self._moved()

    def on_ack(self, conn: ReceiverConn, ack: pb.BucketAck) -> None:
        """The receiver queued its reads of a bucket (its slot is free of it once its read
        event completes), or failed the bucket."""
        if self._owed(conn, f"bucket:{ack.index}", ack.ok) is None:
            return
        rid = conn.receiver_id
        try:
            self.shared.slots.release_reader(rid, self.version, ack.index, ack.read_event)
        except TransportError as e:
            self._failed(conn, error_to_pb(e))
        direct = self.tensors.direct
        if direct is not None and ack.index == direct.index:
            self.direct_readers.discard(rid)
        if not ack.ok:
            self._failed(conn, ack.error)
        self._moved()

    def on_applied(self, conn: ReceiverConn, applied: pb.VersionApplied) -> None:
        """The receiver committed the version, or failed it after writing."""
        outcome = self._owed(conn, "applied", applied.ok)
        if outcome is None:
            return
        if applied.ok:
            outcome.state, outcome.applied_at = OutcomeState.APPLIED, time.time()
            conn.applied(self.version, applied.holds_base and self.audience is None)
            # It committed: it reads nothing more, whether or not it acked every read (else
            # the version would wait for it with no deadline left to end that).
            self.direct_readers.discard(conn.receiver_id)
            self.shared.metrics.receiver_applied(conn.receiver_id, self.version)
        else:
            self._failed(conn, applied.error, wrote=not applied.untouched)
        self._moved()

    def _owed(self, conn: ReceiverConn, what: str, ok: bool = True) -> Outcome | None:
        """The receiver's outcome, ``what`` no longer owed; None for a late reply."""
        outcome = self.outcomes.get(conn.receiver_id)
        if outcome is None or outcome.state != OutcomeState.PENDING:
            return None
        take_owed(outcome, conn.receiver_id, self, what, ok)  # ProtocolError out of turn
        return outcome

    def _moved(self) -> None:
        """A receiver moved on: the version may be staged or over; waiters wake."""
        self.reads_done()
        self.maybe_complete()
        self.shared.cond.notify_all()

    # ---- failures and the version's end ----

    def fail(self, rid: str, error: BaseException | pb.ErrorDetail, notify: bool = True) -> None:
        """Receiver ``rid`` is out of the version; with ``notify``, it is told to abort it."""
        detail = error if isinstance(error, pb.ErrorDetail) else error_to_pb(error)
        outcome = self.outcomes[rid]
        outcome.state, outcome.error = OutcomeState.FAILED, detail
        outcome.awaiting, outcome.deadline = set(), None
        conn = self.shared.registry.receiver(rid)
        conn.left_version(detail, outcome.wrote)
        self.shared.slots.forget_reader(rid)
        self.direct_readers.discard(rid)
        if notify:
            conn.send(pb.Announcement(abort=pb.VersionAbort(version=self.version, reason=detail)))
        self.shared.metrics.receiver_failed(rid)
        self._moved()

    def _failed(self, conn: ReceiverConn, error: pb.ErrorDetail, wrote: bool = True) -> None:
        """Out after writing (weights of no version till the next), or (not ``wrote``) before."""
        (conn.failed_writing if wrote else conn.rejected)(error.message)
        self.outcomes[conn.receiver_id].wrote &= wrote  # buckets announced, none read
        self.fail(conn.receiver_id, error, notify=False)

    def abort(self, detail: pb.ErrorDetail) -> None:
        """Abandon the version: every receiver still in it fails; its publishers get the error."""
        if self.done:
            return
        staged = self.state == VersionState.STAGED  # then failing its last receivers ends it
        if not staged:
            self.abandoned = detail  # first: it is abandoned, not ended by receivers failing
        for rid in self.active():
            self.fail(rid, detail)
        self.shared.slots.release_version(self.version)
        for rank in self.ranks.values():
            rank.outbox.put(WeightSyncError(f"version {self.version} abandoned: {detail.message}"))
        if not staged:
            self._over(VersionState.FAILED, detail.message)
        self.shared.cond.notify_all()

    def reads_done(self) -> None:
        """Staged once every bucket and the end are sent and no receiver still reads direct
        tensors: its publishers hear so (``staged``), and it completes once its receivers are
        done. An abandoned version is not staged."""
        reading = self.state == VersionState.READING
        if not reading or self.direct_readers or self.abandoned is not None:
            return
        self.staged_s = time.monotonic() - self.started_mono
        self.state = VersionState.STAGED
        tell_staged(self)
        self.maybe_complete()
        self.shared.cond.notify_all()

    def maybe_complete(self) -> None:
        """Once staged and no receiver owes anything, the version is over; once every receiver
        it was addressed to failed, at once (its driver stops packing and tells the publishers).
        Receivers that had the end may apply it before it is staged: it completes when staged."""
        if self.active() or self.done:
            return
        if self.state != VersionState.STAGED:
            # A receiver that applied had the end: its driver stages the version next.
            applied = any(o.state == OutcomeState.APPLIED for o in self.outcomes.values())
            if self.outcomes and self.abandoned is None and not applied:
                # Every receiver failed before it was staged: nobody is left to read the rest.
                self.shared.slots.release_version(self.version)
                trace.mark("sender.complete", version=self.version)
                self._over(VersionState.FAILED)
                self.shared.cond.notify_all()
            return
        every = all(o.state == OutcomeState.APPLIED for o in self.outcomes.values())
        trace.mark("sender.complete", version=self.version)
        self._over(VersionState.COMPLETE if every else VersionState.FAILED)

    def _over(self, state: VersionState, why: str = "") -> None:
        """The version is over (``why``: it was abandoned). A staged one's publishers hear
        ``done`` now (an earlier end told them already); its log line is due."""
        staged = self.state == VersionState.STAGED
        self.complete_s = time.monotonic() - self.started_mono
        self.state = state
        if staged:
            tell_done(self)
        self.shared.metrics.version_done(state, self.complete_s)  # after `done`: off its path
        if self.gc_hold is not None:
            self.gc_hold.release()
        self.shared.finished.append((self, why))
