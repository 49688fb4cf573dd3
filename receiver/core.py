"""``ReceiverCore``: the version state machine every engine adapter reuses.

One version: the sender's ``start`` -> validate the manifest (verdict) -> ``begin`` -> per
bucket: read it (:mod:`.reader`, in :mod:`.broadcast`'s landing buffers for broadcast buckets),
load it, ack it -> ``end``: verify checksums, ``commit``, "applied". A failure after ``begin``
aborts the target and tells the sender at once. Announcements come through a
:class:`~.connection.Connection` (gRPC in production, in-memory in unit tests).

A receiver registered with several senders (one per trainer host) has a :class:`Link` per
sender (its connection, broadcast groups and bucket reader) and takes versions split over all
of them: every part's ``start`` -> join the parts (:mod:`.parts`) and validate their union
(verdict to every sender) -> ``begin`` once -> each part's buckets read on a thread per sender
(loads one at a time) -> every part's ``end`` with matching checksums -> ``commit`` once,
"applied" to every sender. A part that fails fails the version for every sender.

What the receiver keeps across versions (each keyed so that a hit is the same bytes or check):

- ``BucketReader._mapped`` (one reader per sender): mapped buffers, by buffer id; never
  dropped (ids are unique).
- ``BucketReader._events``: other processes' CUDA events, by handle; never dropped.
- ``BucketReader._layouts``: parsed bucket layouts, by layout bytes (or layout key); all
  dropped at 512.
- ``KeptByStream`` (one per stream, in the connection's pump): direct buckets' layouts by
  ``layout_key`` and manifests by ``manifest_key``, so one announced by key alone gets them
  back; dropped at 16 of each as the sender counts them (``weightsync.stream_keys``).
- ``BucketReader._views``: a bucket's tensor views, by (layout bytes, buffer ids or landing
  buffer); all dropped at 256, a landing buffer's when it is replaced (it grew:
  ``BroadcastReceiver.landings`` changed), and the target's writes worked out for them with
  them (``WeightTarget.forget_views``).
- ``BucketReader._release_event``: one CUDA event, re-recorded behind every staged bucket.
- ``ReceiverCore._manifests``: parsed manifests, by ``manifest_key`` (an id of their bytes
  without the version: the sender's, or worked out here); all dropped at 16.
- ``ReceiverCore._validated``: the (manifest key, ``target.generation``) last accepted;
  replaced when either changes (a target bumps ``generation`` when it loads another model).
- ``ReceiverCore._kept``: the boxes declared in each verdict, by (manifest key,
  ``target.generation``); all dropped at 16.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from weightsync import gc_pause, trace
from weightsync.buckets import TensorSpec
from weightsync.errors import (
    ConfigError,
    ProtocolError,
    ReceiverFailedError,
    SyncTimeoutError,
    VersionError,
    WeightSyncError,
)
from weightsync.manifest import VersionManifest
from weightsync.receiver.broadcast import BroadcastReceiver
from weightsync.receiver.connection import (
    Connection,
    GrpcConnection,
    WeightsState,
    receiver_hello,
)
from weightsync.receiver.parts import ArrivedPart, check_part, join_parts, refuse_split
from weightsync.receiver.reader import BucketReader, VersionReads
from weightsync.receiver.target import WeightTarget
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import ManifestCache, boxes_to_pb, describe, error_to_pb

# Long enough for a loaded machine to deliver the last "applied" when a receiver is dropped
# or its process exits unclosed: losing it makes the sender report a version this receiver
# did apply as failed. Only paid while the sender is alive and slow; a gone sender ends the
# stream at once.
_LEAVE_FLUSH_S = 10.0
_POLL_S = 0.2
"""How often a part's thread, waiting for its sender, looks whether the version was given up."""


@dataclass(eq=False)
class Link:
    """One sender this receiver is registered with, and what reads that sender's buckets."""

    address: str
    connection: Connection
    broadcast: BroadcastReceiver
    reader: BucketReader
    decline: tuple[int, WeightSyncError] | None = None
    """A version that failed here before this sender's part of it started: its start, when
    it comes, is refused at once with this error."""
    pending: pb.Announcement | None = None
    """A start taken from the connection but left unanswered (the sync() gave up first)."""
    landings: int = 0
    """``broadcast.landings`` when its landing buffers' views were last kept."""


def _leave(links: list[Link], flush_timeout_s: float) -> None:
    for link in links:
        if not link.connection.closed:
            link.connection.close(flush_timeout_s)
            link.broadcast.close()


def as_weightsync_error(error: BaseException, where: str) -> WeightSyncError:
    """``error`` itself when it is a WeightSyncError, else one saying where and what."""
    if isinstance(error, WeightSyncError):
        return error
    return WeightSyncError(f"{where}: {type(error).__name__}: {error}")


class _Stopped(Exception):
    """The version was given up on while a part's thread waited for its sender."""


@dataclass
class _PartsRun:
    """One ``sync()`` of a receiver registered with several senders: a thread per sender
    reports to ``events`` and waits for the core's answer to its start in its ``replies``."""

    links: int
    events: queue.Queue[tuple[int, str, object, str]] = field(default_factory=queue.Queue)
    """(link, "start" | "ended" | "failed", the start message or error, where in the part:
    "its bucket 3", "after its bucket 3" or "")."""
    replies: list[queue.Queue[str]] = field(init=False)
    """Per link: "go" (load the part), "decline" (wait for the next start), "stop"."""
    stop: threading.Event = field(default_factory=threading.Event)
    failed: threading.Event = field(default_factory=threading.Event)
    """A part failed after the writes began: the others read on (their senders and broadcast
    groups keep in step) but load nothing more."""
    version: int = 0
    specs: Sequence[TensorSpec] = ()
    """The version's tensors (every part's), set before any part is told to go."""

    def __post_init__(self) -> None:
        self.replies = [queue.Queue() for _ in range(self.links)]

    def give_up(self) -> None:
        self.stop.set()
        for reply in self.replies:
            reply.put("stop")


class ReceiverCore:
    """Subscribes ``target`` to the sender at ``address`` (or each of several); ``sync()``
    applies versions.

    Registration happens in the constructor, so any version published afterwards is
    addressed to this receiver.

    With several addresses (one sender per trainer host), the receiver registers with each
    and every version comes split over all of them: ``sync()`` waits for every part's start,
    validates their union against the model before any write, loads every part's buckets as
    they come and commits once, when every part ended with matching checksums. A part that
    fails fails the version here (every sender hears it), naming the sender.

    Args:
        target: the engine adapter that validates and loads tensors.
        address: the sender's ``unix:/path`` or ``host:port``, or every sender's.
        engine, rank: how this receiver shows in ``weightsync status``.
        receiver_id: unique per engine worker (default: generated).
        verify_checksums: compare every bucket's checksum with the sender's before committing
            the version (computed on the device as buckets arrive).
        part_timeout_s: with several senders, how long after a version's first part the
            others may start; a part later than that fails the version before any write.
        connection: an open connection to use instead of registering at ``address`` (tests:
            an in-memory one, which carries no broadcast joins), or one per address.

    Raises:
        ConfigError: no address, or one given twice.
        TransportError: no sender answers at an address.
    """

    def __init__(
        self,
        target: WeightTarget,
        address: str | Sequence[str],
        *,
        engine: str = "torch",
        rank: int = 0,
        receiver_id: str | None = None,
        verify_checksums: bool = True,
        connect_timeout_s: float = 10.0,
        transports: tuple[str, ...] = ("shm", "cuda_ipc"),
        part_timeout_s: float = 60.0,
        connection: Connection | Sequence[Connection] | None = None,
    ) -> None:
        self.target = target
        self.address = address
        self.addresses = (address,) if isinstance(address, str) else tuple(address)
        if not self.addresses or len(set(self.addresses)) != len(self.addresses):
            raise ConfigError(
                f"a receiver registers with each sender once; got addresses {self.addresses!r}"
            )
        connections = (
            [connection]
            if connection is not None and not isinstance(connection, Sequence)
            else connection
        )
        if connections is not None and len(connections) != len(self.addresses):
            raise ConfigError(
                f"{len(connections)} connection(s) for {len(self.addresses)} address(es)"
            )
        self.verify_checksums = verify_checksums
        self.part_timeout_s = part_timeout_s
        self._weights = WeightsState()
        """Shared with the connections, which tell their sender in every hello (not ``self``:
        a connection must not keep this object alive, see ``_leave_finalizer``)."""
        self.last_error: WeightSyncError | None = None
        self._manifests = ManifestCache()
        self._validated: tuple[bytes, int] | None = None
        self._kept: dict[tuple[bytes, int], list[pb.TensorBox]] = {}
        """(manifest key, target generation) the target last accepted: the same tensor list
        for the same model need not be checked again."""
        self._load_lock = threading.Lock()
        """Parts load from a thread each; the target takes one bucket at a time."""
        self._touched = False
        """Did any write of the version in flight reach the model? (``dirty`` on failure)"""
        trace.set_role("receiver")
        hello = receiver_hello(
            target.device,
            engine=engine,
            rank=rank,
            receiver_id=receiver_id,
            transports=transports,
        )
        self._connect_timeout_s = connect_timeout_s
        self._links: list[Link] = []
        try:
            for i, where in enumerate(self.addresses):
                self._links.append(
                    self._link(where, hello, connections[i] if connections else None)
                )
        except BaseException:
            _leave(self._links, 0.0)  # the senders already registered with see us leave
            raise
        self.receiver_id = self._links[0].connection.receiver_id
        # A receiver dropped right after sync() (a function's local, a process that exits)
        # must still deliver its last "applied": the finalizer holds the parts, not self.
        self._leave_finalizer = weakref.finalize(self, _leave, self._links, _LEAVE_FLUSH_S)

    def _link(self, address: str, hello: pb.ReceiverHello, connection: Connection | None) -> Link:
        broadcast = BroadcastReceiver(self.target.device)
        if connection is None:
            own = pb.ReceiverHello()
            own.CopyFrom(hello)  # each connection fills in its own registration
            connection = GrpcConnection(
                address,
                own,
                # Joined from the connection's thread: the sender waits for every member
                # before a version's first broadcast, and must not wait for sync().
                on_join=broadcast.join,
                weights=self._weights,
                connect_timeout_s=self._connect_timeout_s,
            )
        reader = BucketReader(
            self.target.device,
            chunks_in_place=self.target.chunks_in_place,
            verify_checksums=self.verify_checksums,
        )
        return Link(address, connection, broadcast, reader)

    @property
    def applied_version(self) -> int:
        """The last version applied; 0: none since this receiver started."""
        return self._weights.applied_version

    @property
    def dirty(self) -> bool:
        """True when a failed version wrote some weights: they match no version until the next."""
        return self._weights.dirty

    def sync(self, timeout: float | None = None, version: int | None = None) -> int:
        """Apply the next version announced to this receiver and return it.

        Waits up to ``timeout`` seconds (None: forever) for a version to start (with several
        senders: its first part; the others then get ``part_timeout_s``). With ``version``, an
        earlier one still announced (its caller gave up waiting for it) is declined unapplied
        and the wait goes on.

        Raises:
            NameResolutionError, ManifestMismatchError: the manifest does not fit the model;
                nothing was written, the previous version stays.
            PlanError: a version split over several senders that this receiver cannot join
                (registered with one sender, or parts that disagree); nothing was written.
            ChecksumError: a bucket arrived corrupted; ``dirty`` says whether weights changed.
            ReceiverFailedError: the sender gave up on this receiver for the version.
            TransportError: the sender went away.
            SyncTimeoutError: no version in time, or a part that never started.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if len(self._links) > 1:
            return self._sync_parts(deadline, version or 0)
        (link,) = self._links
        msg = link.connection.next(deadline, "version", in_version=False)
        while msg.WhichOneof("kind") != "start" or msg.start.manifest.version < (version or 0):
            if msg.WhichOneof("kind") == "start":
                self._decline(link, msg.start.manifest.version, version)
            # Else leftovers of a version already left.
            msg = link.connection.next(deadline, "version", in_version=False)
        trace.mark("receiver.start")
        with gc_pause.paused():
            return self._start(link, msg.start)

    def _start(self, link: Link, start: pb.VersionStart) -> int:
        """Apply the version ``start`` begins (or refuse it, nothing written)."""
        version = start.manifest.version
        try:
            # Parsing bounds every field too: a manifest past a bound is rejected like one
            # that does not fit the model, before any write.
            manifest, key = self._manifest(link, start)
            refuse_split(manifest, link.address)
            self._validate(manifest, key)
            keeps = self._keeps(manifest, key)  # the target's own code: may raise too
        except Exception as e:
            error = self._refuse([link], version, e)
            if error is e:
                raise
            raise error from e
        return self._apply(link, manifest, lambda: self._verdict(link, version, None, keeps))

    def _manifest(self, link: Link, start: pb.VersionStart) -> tuple[VersionManifest, bytes]:
        """The version's manifest and its key; a manifest sent by key alone is taken from the
        stream's copy only when the cache let it go."""
        msg = start.manifest
        if start.manifest_key and not msg.tensors and start.manifest_key not in self._manifests:
            msg = link.connection.kept.manifest(start)
        return self._manifests(msg, start.manifest_key)

    def _verdict(
        self,
        link: Link,
        version: int,
        error: WeightSyncError | None,
        keeps: list[pb.TensorBox] | None = None,
    ) -> None:
        verdict = pb.ManifestVerdict(version=version, accepted=error is None)
        if error is not None:
            verdict.error.CopyFrom(error_to_pb(error))
        elif keeps is not None:
            link.connection.kept.declare(verdict, keeps)
        link.connection.send(pb.ReceiverMessage(verdict=verdict))

    def _keeps(self, manifest: VersionManifest, key: bytes) -> list[pb.TensorBox]:
        """The boxes of ``manifest``'s tensors the target keeps (after validating), declared
        in the verdict so the sender plans this receiver's bytes."""
        cached = (key, self.target.generation)
        if cached not in self._kept:
            if len(self._kept) >= 16:
                self._kept.clear()
            kept = self.target.kept()
            names = {spec.name for spec in manifest.tensors} if kept else set()
            self._kept[cached] = boxes_to_pb({n: b for n, b in kept.items() if n in names})
        return self._kept[cached]

    def _refuse(self, links: Sequence[Link], version: int, e: Exception) -> WeightSyncError:
        """Reject ``version`` before any write, telling the senders of ``links``; returns the
        error to raise."""
        error = as_weightsync_error(e, f"validating version {version}")
        for link in links:
            self._verdict(link, version, error)
        self.last_error = error
        return error

    def _decline(self, link: Link, stale: int, wanted: int | None) -> None:
        """Reject ``stale`` before any write: the sender ends it for us at once instead of
        waiting out its ack timeout."""
        error = VersionError(
            f"receiver {self.receiver_id} skipped version {stale}: its engine asked for "
            f"version {wanted} (version {stale} was given up on)"
        )
        self._verdict(link, stale, error)

    def _validate(self, manifest: VersionManifest, key: bytes) -> None:
        validated = (key, self.target.generation)
        if validated != self._validated:
            self.target.validate(manifest)
            self._validated = validated

    def _begin(self, manifest: VersionManifest) -> None:
        self._touched = False
        self._weights.applying = True
        self.target.begin(manifest)

    def _bucket(
        self,
        link: Link,
        bucket: pb.BucketAnnouncement,
        version: int,
        reads: VersionReads,
        load: bool,
        launched: Callable[[], None] | None = None,
    ) -> None:
        """Read one bucket into the model (``load``) or only take part in its transfer (its
        version already failed here: the sender and its broadcast group go on in step).
        ``bucket`` has its layout (:meth:`KeptByStream.bucket`: it may be an announcement of an
        earlier version); ``version``: the one it was announced for now. ``launched`` is called
        once its copies are under way."""
        read_event = b""
        with link.broadcast.reading(bucket) as landed:
            if load:
                if landed is not None and link.landings != link.broadcast.landings:
                    # A landing buffer was replaced: views of the old one are kept no longer.
                    # Under the load lock: another sender's part may be loading meanwhile.
                    link.reader.forget_landed()
                    with self._load_lock:
                        self.target.forget_views()
                    link.landings = link.broadcast.landings
                prepared = link.reader.prepare(bucket, reads, landed)
                with self._load_lock:
                    self._touched = True
                    prepared.write(self.target)
                    trace.gpu_mark(
                        "receiver.gpu_loaded", link.broadcast.device, index=bucket.layout.index
                    )
                if launched is not None:
                    launched()
                read_event = link.reader.release(bucket, prepared, reads)
        trace.mark("receiver.queued", index=bucket.layout.index)
        ack = pb.BucketAck(
            version=version, index=bucket.layout.index, ok=True, read_event=read_event
        )
        link.connection.send(pb.ReceiverMessage(ack=ack))

    def _end(self, link: Link, reads: VersionReads, end: pb.VersionEnd) -> None:
        """Every read of the sender's buckets done, and their checksums its own."""
        reads.require_complete()
        reads.wait()
        link.broadcast.synchronize()
        trace.flush_gpu()
        trace.mark("receiver.loaded", version=reads.version)
        reads.check(end)

    def _abandoned(self, version: int, abort: pb.VersionAbort) -> ReceiverFailedError:
        return ReceiverFailedError(
            f"the sender abandoned version {version} for receiver {self.receiver_id}: "
            f"{describe(abort.reason)}"
        )

    def _commit(self, manifest: VersionManifest) -> int:
        version = manifest.version
        self.target.commit(manifest)
        trace.mark("receiver.committed", version=version)
        for link in self._links:
            link.connection.send(
                pb.ReceiverMessage(applied=pb.VersionApplied(version=version, ok=True))
            )
        self._weights.applied_version, self._weights.dirty = version, False
        self.last_error = None
        return version

    def _fail(
        self, manifest: VersionManifest, error: WeightSyncError, tell: Sequence[Link]
    ) -> None:
        """Whatever failed after ``begin`` (an engine's loader raises its own types too), the
        target rolls back what it can, ``dirty`` says whether weights changed, and the senders
        of ``tell`` hear why at once instead of waiting out their ack timeout."""
        self._weights.dirty = self._weights.dirty or self._touched
        self.last_error = error
        try:
            self.target.abort(manifest, error)
        finally:
            failed = pb.VersionApplied(version=manifest.version, ok=False, error=error_to_pb(error))
            for link in tell:
                if not link.connection.closed:
                    link.connection.send(pb.ReceiverMessage(applied=failed))

    def _apply(self, link: Link, manifest: VersionManifest, accept: Callable[[], None]) -> int:
        """Apply the version ``manifest`` starts; ``accept`` sends the verdict: at once, or,
        when its first bucket is in hand already (a direct-only version's start, bucket and
        end come in one message), once that bucket's copies are launched (~0.1 ms sooner)."""
        version = manifest.version
        reads = VersionReads(version, manifest.tensors)
        index = -1
        waiting_for = f"bucket of version {version}"
        try:
            msg = _in_hand(link, waiting_for)
            if msg is None or msg.WhichOneof("kind") != "bucket":
                accept()
                accept = None
            self._begin(manifest)
            while True:
                if msg is None:
                    msg = link.connection.next(None, waiting_for, in_version=True)
                kind = msg.WhichOneof("kind")
                trace.mark(f"receiver.{kind}", index=msg.bucket.layout.index)
                if kind == "bucket":
                    bucket = link.connection.kept.bucket(msg.bucket)
                    index = bucket.layout.index
                    self._bucket(
                        link, bucket, msg.bucket.version, reads, load=True, launched=accept
                    )
                    accept = None
                elif kind == "end":
                    self._end(link, reads, msg.end)
                    return self._commit(manifest)
                elif kind == "abort":
                    raise self._abandoned(version, msg.abort)
                else:
                    raise ProtocolError(f"unexpected {kind} inside version {version}")
                msg = None
        except Exception as e:
            where = f"version {version}" + (f", bucket {index}" if index >= 0 else "")
            error = as_weightsync_error(e, where)
            self._fail(manifest, error, [] if isinstance(error, ReceiverFailedError) else [link])
            if error is e:
                raise
            raise error from e
        finally:
            self._weights.applying = False

    # ---- a version split over several senders ------------------------------------------------

    def _sync_parts(self, deadline: float | None, wanted: int) -> int:
        run = _PartsRun(len(self._links))
        threads = [
            threading.Thread(
                target=self._run_part, args=(i, run), daemon=True, name=f"weightsync-part-{i}"
            )
            for i in range(len(self._links))
        ]
        for thread in threads:
            thread.start()
        try:
            return self._join_parts(run, deadline, wanted)
        finally:
            run.give_up()
            for thread in threads:
                thread.join()

    def _next(
        self, link: Link, run: _PartsRun, waiting_for: str, in_version: bool
    ) -> pb.Announcement:
        """The sender's next announcement, looking every ``_POLL_S`` whether ``run`` was
        given up on (then ``_Stopped``)."""
        while not run.stop.is_set():
            try:
                return link.connection.next(time.monotonic() + _POLL_S, waiting_for, in_version)
            except SyncTimeoutError:
                continue
        raise _Stopped

    def _run_part(self, i: int, run: _PartsRun) -> None:
        """One sender's part of ``run``, on a thread of its own: its start (answered by
        :meth:`_join_parts`), then its buckets, each read as it comes."""
        link = self._links[i]
        try:
            while True:
                msg, link.pending = link.pending, None
                if msg is None:
                    msg = self._next(link, run, "version", in_version=False)
                if msg.WhichOneof("kind") != "start":
                    continue  # leftovers of a version already left
                run.events.put((i, "start", msg, -1))
                reply = run.replies[i].get()
                if reply == "go":
                    break
                if reply == "stop":
                    link.pending = msg  # unanswered: the next sync() takes it up
                    return
        except _Stopped:
            return
        except Exception as e:
            run.events.put((i, "failed", e, ""))
            return
        version, where = run.version, ""
        reads = VersionReads(version, run.specs)
        try:
            while True:
                msg = self._next(link, run, f"bucket of version {version}", in_version=True)
                kind = msg.WhichOneof("kind")
                trace.mark(f"receiver.{kind}", index=msg.bucket.layout.index)
                if kind == "bucket":
                    bucket = link.connection.kept.bucket(msg.bucket)
                    where = f"its bucket {bucket.layout.index}"
                    load = not run.failed.is_set()
                    self._bucket(link, bucket, msg.bucket.version, reads, load=load)
                    where = f"after {where}"
                elif kind == "end":
                    if not run.failed.is_set():
                        self._end(link, reads, msg.end)
                    break
                elif kind == "abort":
                    raise self._abandoned(version, msg.abort)
                else:
                    raise ProtocolError(f"unexpected {kind} inside version {version}")
        except _Stopped:
            return
        except Exception as e:
            run.failed.set()  # the other parts stop loading at once
            run.events.put((i, "failed", e, where))
            return
        run.events.put((i, "ended", None, where))

    def _join_parts(self, run: _PartsRun, deadline: float | None, wanted: int) -> int:
        """Wait for every sender's start of one version, validate their union, then apply."""
        started: dict[int, pb.VersionStart] = {}
        parts_by: float | None = None
        while len(started) < len(self._links):
            until = parts_by if started else deadline
            try:
                i, kind, payload, _ = run.events.get(
                    timeout=None if until is None else max(until - time.monotonic(), 0.0)
                )
            except queue.Empty:
                if not started:
                    raise SyncTimeoutError(
                        f"receiver {self.receiver_id}: no version in time from any of the "
                        f"senders at {', '.join(self.addresses)}"
                    ) from None
                late = next(j for j in range(len(self._links)) if j not in started)
                got = ", ".join(self._links[j].address for j in sorted(started))
                raise self._give_up(
                    run,
                    started,
                    SyncTimeoutError(
                        f"version {run.version}: the part from the sender at "
                        f"{self._links[late].address} did not start within "
                        f"{self.part_timeout_s:g} s of the parts from {got}; the version "
                        f"fails on receiver {self.receiver_id} before any write"
                    ),
                ) from None
            if kind == "failed":
                assert isinstance(payload, Exception)
                raise self._give_up(run, started, as_weightsync_error(payload, "a part's start"))
            assert isinstance(payload, pb.Announcement)
            link, version = self._links[i], payload.start.manifest.version
            if link.decline is not None and link.decline[0] == version:
                self._verdict(link, version, link.decline[1])
                link.decline = None
                run.replies[i].put("decline")
            elif version < wanted:
                self._decline(link, version, wanted)
                run.replies[i].put("decline")
            elif version < run.version:
                self._superseded(link, version, run.version)
                run.replies[i].put("decline")
            else:
                if version > run.version:
                    for j in started:
                        self._superseded(self._links[j], run.version, version)
                        run.replies[j].put("decline")
                    started.clear()
                    parts_by = time.monotonic() + self.part_timeout_s
                run.version = version
                started[i] = payload.start
        trace.mark("receiver.start")
        # Paused from every part's start, not while waiting for one (an engine may wait long).
        with gc_pause.paused():
            return self._start_parts(run, started)

    def _start_parts(self, run: _PartsRun, started: dict[int, pb.VersionStart]) -> int:
        """Validate the union of every sender's part of ``run``, then apply it (or refuse it
        before any write, telling every sender)."""
        arrived, keys = [], []
        try:
            for i in range(len(self._links)):
                manifest, key = self._manifest(self._links[i], started[i])
                arrived.append(ArrivedPart(self._links[i].address, manifest))
                check_part(arrived[-1], self.addresses)
                keys.append(len(key).to_bytes(8, "little") + key)
            union = join_parts(arrived)
            self._validate(union, b"".join(keys))
            keeps = [
                self._keeps(part.manifest, key) for part, key in zip(arrived, keys, strict=True)
            ]
        except Exception as e:
            error = self._refuse(self._links, run.version, e)
            for reply in run.replies:
                reply.put("decline")
            if error is e:
                raise
            raise error from e
        for link, kept in zip(self._links, keeps, strict=True):
            self._verdict(link, run.version, None, kept)
        return self._apply_parts(run, arrived, union)

    def _superseded(self, link: Link, stale: int, newer: int) -> None:
        self._verdict(
            link,
            stale,
            VersionError(
                f"receiver {self.receiver_id} skipped version {stale} from the sender at "
                f"{link.address}: it waits for version {newer}, which another sender started"
            ),
        )

    def _give_up(
        self, run: _PartsRun, started: dict[int, pb.VersionStart], error: WeightSyncError
    ) -> WeightSyncError:
        """Fail ``run`` before any write: the senders whose part started hear it now, the
        others when theirs starts."""
        for i, link in enumerate(self._links):
            if i in started:
                self._verdict(link, run.version, error)
                run.replies[i].put("decline")
            elif run.version:
                link.decline = (run.version, error)
        self.last_error = error
        return error

    def _apply_parts(
        self, run: _PartsRun, arrived: list[ArrivedPart], union: VersionManifest
    ) -> int:
        """Load every part as its buckets come, each on its own thread; commit once all ended
        with matching checksums. A part that fails stops the loads, and, once every sender
        ended its part (their streams and broadcast groups stay in step), fails the version
        for every sender."""
        failure: tuple[int, str, Exception] | None = None
        """(link, where in its part, what failed); link -1: the target's begin or commit."""
        run.specs = union.tensors
        try:
            try:
                self._begin(union)
            except Exception as e:
                failure = (-1, "", e)
                run.failed.set()
            for reply in run.replies:
                reply.put("go")
            for _ in self._links:
                i, kind, payload, where = run.events.get()
                if kind == "failed" and failure is None:
                    assert isinstance(payload, Exception)
                    failure = (i, where, payload)
            if failure is None:
                try:
                    return self._commit(union)
                except Exception as e:
                    failure = (-1, "", e)
            i, where, cause = failure
            error = self._part_error(union.version, arrived[i] if i >= 0 else None, where, cause)
            aborted = isinstance(cause, ReceiverFailedError)
            tell = [link for j, link in enumerate(self._links) if not (aborted and j == i)]
            self._fail(union, error, tell)
            raise error from cause
        finally:
            self._weights.applying = False

    def _part_error(
        self, version: int, part: ArrivedPart | None, where: str, cause: Exception
    ) -> WeightSyncError:
        """``cause`` saying which sender's part (and bucket) failed the version, and whether
        the weights are now dirty."""
        context = ", ".join(str(x) for x in (part, where) if x)
        error = as_weightsync_error(
            cause, f"version {version}" + (f", {context}" if context else "")
        )
        message = f"version {version} failed on receiver {self.receiver_id}"
        message += f": {context}: {error}" if context else f": {error}"
        if self._touched:
            message += (
                ". The weights are dirty (buckets of the version were written before it "
                "failed): the next version every sender sends heals them"
            )
        return type(error)(message)

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Deliver pending acks, then leave: ending our streams lets the senders end theirs."""
        self._leave_finalizer.detach()
        _leave(self._links, flush_timeout_s)

    def __enter__(self) -> ReceiverCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _in_hand(link: Link, waiting_for: str) -> pb.Announcement | None:
    """The sender's next announcement if it arrived already, else None."""
    try:
        return link.connection.next(time.monotonic(), waiting_for, in_version=True)
    except SyncTimeoutError:
        return None
