"""``ReceiverCore``: the version state machine every engine adapter reuses.

One version from one sender (``ReceiverCore._apply``): the sender's ``start`` -> validate the
manifest unless accepted last (:mod:`.accepted`; verdict) -> ``begin`` -> per
bucket: read it (:mod:`.reader`, in :mod:`.broadcast`'s landing buffers for broadcast buckets),
load it, ack it -> ``end``: verify checksums, ``commit``, "applied". A failure after ``begin``
aborts the target and tells the sender at once. Announcements come through a
:class:`~.connection.Connection` (gRPC in production, in-memory in unit tests).

A receiver registered with several senders (one per trainer host) has a :class:`~.links.Link`
per sender and takes versions split over all of them (:mod:`.several_senders`). What the
receiver keeps across versions, and what drops it: docs/caches.md.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence

from weightsync import gc_pause, trace
from weightsync.config import ClientSettings
from weightsync.errors import ConfigError, ProtocolError, ReceiverFailedError, WeightSyncError
from weightsync.manifest import VersionManifest
from weightsync.receiver.accepted import Accepted
from weightsync.receiver.connection import Connection, WeightsState, receiver_hello
from weightsync.receiver.exports import Exporter
from weightsync.receiver.links import (
    HeldAcks,
    Link,
    abandoned,
    as_weightsync_error,
    decline,
    in_hand,
    leave,
    open_link,
)
from weightsync.receiver.parts import refuse_split
from weightsync.receiver.reader import VersionReads
from weightsync.receiver.several_senders import SeveralSenders
from weightsync.receiver.target import WeightTarget
from weightsync.transports.cuda_ipc import QueuedWork
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import error_to_pb

# Long enough for a loaded machine to deliver the last "applied" when a receiver is dropped
# or its process exits unclosed: losing it makes the sender report a version this receiver
# did apply as failed. Only paid while the sender is alive and slow; a gone sender ends the
# stream at once.
_LEAVE_FLUSH_S = 10.0


class ReceiverCore(SeveralSenders):
    """Subscribes ``target`` to the sender at ``address`` (or each of several); ``sync()``
    applies versions.

    Registration happens in the constructor, so any version published afterwards is
    addressed to this receiver.

    With several addresses (one sender per trainer host), every version comes split over
    them (:mod:`.several_senders`); a part that fails fails it here, naming the sender.

    Args:
        target: the engine adapter that validates and loads tensors.
        address: the sender's ``unix:/path`` or ``host:port``, or every sender's.
        engine, rank: how this receiver shows in ``weightsync status``.
        receiver_id: unique per engine worker (default: generated).
        verify_checksums: compare every bucket's checksum with the sender's before committing
            the version (computed on the device as buckets arrive).
        part_timeout_s: with several senders, how long after a version's first part the
            others may start; a part later than that fails the version before any write.
        delta_bytes: keep each broadcast bucket's last bytes, up to this many in all, so the
            sender may send the next version's as deltas (None:
            ``WEIGHTSYNC_RECEIVER_DELTA_BYTES``, default 0: off).
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
        delta_bytes: int | None = None,
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
        self._load_lock = threading.Lock()
        """Parts load from a thread each; the target takes one bucket at a time."""
        self._touched = False
        """Did any write of the version in flight reach the model? (``dirty`` on failure)"""
        trace.set_role("receiver")
        # A catch-up source hands out whole versions: not one of a split version's parts.
        exports = target.exports and len(self.addresses) == 1
        hello = receiver_hello(
            target.device,
            engine=engine,
            rank=rank,
            receiver_id=receiver_id,
            transports=transports,
            exports=exports,
        )
        self._accepted = Accepted(hello.receiver_id)
        settings = ClientSettings()
        delta_bytes = settings.receiver_delta_bytes if delta_bytes is None else delta_bytes
        self._sender_writes = settings.receiver_sender_writes
        hello.deltas = delta_bytes > 0
        exporter = Exporter(target, self._weights, self._load_lock) if exports else None
        self._links: list[Link] = []
        try:
            for i, where in enumerate(self.addresses):
                connection = connections[i] if connections else None
                self._links.append(
                    open_link(
                        where,
                        hello,
                        connection,
                        target,
                        verify_checksums,
                        self._weights,
                        connect_timeout_s,
                        exporter,
                        delta_bytes,
                    )
                )
        except BaseException:
            leave(self._links, 0.0)  # the senders already registered with see us leave
            raise
        self.receiver_id = self._links[0].connection.receiver_id
        # A receiver dropped right after sync() (a function's local, a process that exits)
        # must still deliver its last "applied": the finalizer holds the parts, not self.
        self._leave_finalizer = weakref.finalize(self, leave, self._links, _LEAVE_FLUSH_S)

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
        earlier one still announced (its caller gave up waiting for it) is declined unapplied.

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
                decline(link, self.receiver_id, msg.start.manifest.version, version)
            # Else leftovers of a version already left.
            msg = link.connection.next(deadline, "version", in_version=False)
        trace.mark("receiver.start")
        with gc_pause.paused():
            return self._apply(link, msg.start)

    def _refuse(self, links: Sequence[Link], version: int, e: Exception) -> WeightSyncError:
        """Reject ``version`` before any write, telling the senders of ``links``; returns the
        error to raise."""
        error = as_weightsync_error(e, f"validating version {version}")
        for link in links:
            link.verdict(version, error)
        self.last_error = error
        return error

    def _begin(self, manifest: VersionManifest, writes: bool = False) -> None:
        # writes: the sender writes from the verdict on (touched); the lock orders exports.
        with self._load_lock:
            self._touched = writes
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
        written: bool = False,
    ) -> tuple[pb.BucketAck, QueuedWork | None]:
        """Read one bucket into the model (``load``) or only take part in its transfer (its
        version already failed here: the sender and its broadcast group go on in step).
        ``bucket`` has its layout (:meth:`.Link.bucket`: it may be an announcement of an
        earlier version); ``version``: the one it was announced for now. ``launched`` is called
        once its copies are under way. A bucket the sender wrote into the weights itself
        (``written``: this version let it, protocol §4.3) is only acked. Returns the ack, for
        the caller to send once the reads returned with it are done (:class:`.HeldAcks`)."""
        read_event, unfinished, index = b"", None, bucket.layout.index
        if bucket.written and not written:
            what = f"bucket {index} of version {version} came as written"
            raise ProtocolError(f"{what} into weights this receiver did not offer the sender")
        with link.broadcast.reading(bucket) as landed:
            if load and not bucket.written and not (bucket.group_id and link.broadcast.failure):
                if landed is not None and link.landings != link.broadcast.landings:
                    # A landing buffer was replaced: views of the old one are kept no longer
                    # (the target hears it with this bucket's arrival).
                    link.reader.forget_landed()
                    link.landings = link.broadcast.landings
                prepared = link.reader.prepare(bucket, reads, landed)
                trace.gpu_mark("receiver.gpu_began", link.broadcast.device, index=index)
                with self._load_lock:
                    self._touched = True
                    prepared.write(self.target)
                    trace.gpu_mark("receiver.gpu_loaded", link.broadcast.device, index=index)
                if launched is not None:
                    launched()
                    launched = None
                read_event, unfinished = link.reader.release(bucket, prepared, reads)
        if launched is not None:  # nothing read here: the verdict goes now
            launched()
        trace.mark("receiver.queued", index=index)
        ack = pb.BucketAck(version=version, index=index, ok=True, read_event=read_event)
        return ack, unfinished

    def _end(self, link: Link, reads: VersionReads, end: pb.VersionEnd) -> None:
        """Every read of the sender's buckets done, and their checksums its own; what the
        broadcast buckets left is kept as the next delta base."""
        link.broadcast.ended(end)
        reads.require_complete()
        reads.wait()
        link.broadcast.synchronize()
        trace.flush_gpu()
        trace.mark("receiver.loaded", version=reads.version)
        reads.check(end)
        link.broadcast.applied(end)

    def _commit(
        self, manifest: VersionManifest, folded: tuple[Link, pb.BucketAck] | None = None
    ) -> int:
        """Commit and tell every sender; ``folded``: a sender's last ack, held back to go with
        its applied (``VersionApplied.acks``)."""
        version = manifest.version
        self.target.commit(manifest)
        trace.mark("receiver.committed", version=version)
        for link in self._links:
            holds = link.broadcast.holds == version
            applied = pb.VersionApplied(version=version, ok=True, holds_base=holds)
            if folded is not None and folded[0] is link:
                applied.acks.append(folded[1])
            link.connection.send(pb.ReceiverMessage(applied=applied))
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
            failed = pb.VersionApplied(
                version=manifest.version,
                ok=False,
                error=error_to_pb(error),
                untouched=not self._touched,
            )
            for link in tell:
                if not link.connection.closed:
                    link.connection.send(pb.ReceiverMessage(applied=failed))

    def _apply(self, link: Link, start: pb.VersionStart) -> int:
        """Apply the version ``start`` begins from the one sender, or refuse it before any
        write. The verdict goes at once or, when the version's first bucket is in hand
        already (a direct-only version's start, bucket and end come in one message), once
        that bucket's copies are launched (~0.1 ms sooner)."""
        version = start.manifest.version
        try:
            manifest, key = self._accepted.manifest(link, start)
            refuse_split(manifest, link.address)
            self._accepted.validate(self.target, manifest, key)
            keeps = self._accepted.keeps(self.target, manifest, key)  # the target's code too
            takes = self._sender_writes and link.connection.kept.takes_writes
            writes = self._accepted.writes(self.target, manifest, key) if takes else None
        except Exception as e:
            error = self._refuse([link], version, e)
            if error is e:
                raise
            raise error from e

        def accept() -> None:
            link.verdict(version, None, keeps, writes)

        pending: Callable[[], None] | None = accept
        reads = VersionReads(version, manifest.tensors)
        index = -1
        folded: pb.BucketAck | None = None
        acks = HeldAcks(link)
        waiting_for = f"bucket of version {version}"
        try:
            msg = in_hand(link, waiting_for)
            if writes is not None:  # begun before the sender may write
                self._begin(manifest, writes=True)
            if msg is None or msg.WhichOneof("kind") != "bucket":
                accept()
                pending = None
            if writes is None:
                self._begin(manifest)
            while True:
                if msg is None:
                    msg = link.connection.next(None, waiting_for, in_version=True)
                kind = msg.WhichOneof("kind")
                trace.mark(f"receiver.{kind}", index=msg.bucket.layout.index)
                if kind == "bucket":
                    bucket = link.bucket(msg.bucket)
                    index, written = bucket.layout.index, writes is not None
                    at = msg.bucket.version  # announced now (``bucket`` may be kept)
                    ack, unfinished = self._bucket(link, bucket, at, reads, True, pending, written)
                    pending = None
                    folded, msg = acks.after(ack, unfinished, waiting_for)
                    continue
                elif kind == "end":
                    self._end(link, reads, msg.end)
                    return self._commit(manifest, None if folded is None else (link, folded))
                elif kind == "abort":
                    raise abandoned(self.receiver_id, version, msg.abort)
                else:
                    raise ProtocolError(f"unexpected {kind} inside version {version}")
                msg = None
        except Exception as e:
            acks.abandon(send=not link.connection.closed)
            if folded is not None and not link.connection.closed:
                link.connection.send(pb.ReceiverMessage(ack=folded))  # before the failure
            where = f"version {version}" + (f", bucket {index}" if index >= 0 else "")
            error = as_weightsync_error(e, where)
            self._fail(manifest, error, [] if isinstance(error, ReceiverFailedError) else [link])
            if error is e:
                raise
            raise error from e
        finally:
            self._weights.applying = False

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Deliver pending acks, then leave: ending our streams lets the senders end theirs."""
        self._leave_finalizer.detach()
        leave(self._links, flush_timeout_s)

    def __enter__(self) -> ReceiverCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
