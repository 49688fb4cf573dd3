"""``ReceiverCore``: the version state machine every engine adapter reuses.

One version: the sender's ``start`` -> validate the manifest (verdict) -> ``begin`` -> per
bucket: read it (:mod:`.reader`, in :mod:`.broadcast`'s landing buffers for broadcast buckets),
load it, ack it -> ``end``: verify checksums, ``commit``, "applied". A failure after ``begin``
aborts the target and tells the sender at once. Announcements come through a
:class:`~.connection.Connection` (gRPC in production, in-memory in unit tests).

What the receiver keeps across versions (each keyed so that a hit is the same bytes or check):

- ``BucketReader._mapped``: mapped buffers, by buffer id; never dropped (ids are unique).
- ``BucketReader._events``: other processes' CUDA events, by handle; never dropped.
- ``BucketReader._layouts``: parsed bucket layouts, by layout bytes; all dropped at 512.
- ``BucketReader._views``: a bucket's tensor views, by (layout bytes, buffer ids); all dropped
  at 256. Broadcast buckets are viewed afresh (landing buffers are replaced when they grow).
- ``BucketReader._release_event``: one CUDA event, re-recorded behind every staged bucket.
- ``ReceiverCore._manifests``: parsed manifests, by their bytes without the version; all
  dropped at 16.
- ``ReceiverCore._validated``: the (manifest key, ``target.generation``) last accepted;
  replaced when either changes (a target bumps ``generation`` when it loads another model).
"""

from __future__ import annotations

import time
import weakref

from weightsync import trace
from weightsync.errors import ProtocolError, ReceiverFailedError, VersionError, WeightSyncError
from weightsync.manifest import VersionManifest
from weightsync.receiver.broadcast import BroadcastReceiver
from weightsync.receiver.connection import (
    Connection,
    GrpcConnection,
    WeightsState,
    receiver_hello,
)
from weightsync.receiver.reader import BucketReader, VersionReads
from weightsync.receiver.target import WeightTarget
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import ManifestCache, describe, error_to_pb

# Long enough for a loaded machine to deliver the last "applied" when a receiver is dropped
# or its process exits unclosed: losing it makes the sender report a version this receiver
# did apply as failed. Only paid while the sender is alive and slow; a gone sender ends the
# stream at once.
_LEAVE_FLUSH_S = 10.0


def _leave(connection: Connection, broadcast: BroadcastReceiver, flush_timeout_s: float) -> None:
    if connection.closed:
        return
    connection.close(flush_timeout_s)
    broadcast.close()


def as_weightsync_error(error: BaseException, where: str) -> WeightSyncError:
    """``error`` itself when it is a WeightSyncError, else one saying where and what."""
    if isinstance(error, WeightSyncError):
        return error
    return WeightSyncError(f"{where}: {type(error).__name__}: {error}")


class ReceiverCore:
    """Subscribes ``target`` to the sender at ``address``; ``sync()`` applies versions.

    Registration happens in the constructor, so any version published afterwards is
    addressed to this receiver.

    Args:
        target: the engine adapter that validates and loads tensors.
        address: the sender's ``unix:/path`` or ``host:port``.
        engine, rank: how this receiver shows in ``weightsync status``.
        receiver_id: unique per engine worker (default: generated).
        verify_checksums: compare every bucket's checksum with the sender's before committing
            the version (computed on the device as buckets arrive).
        connection: an open connection to use instead of registering at ``address`` (tests:
            an in-memory one, which carries no broadcast joins).

    Raises:
        TransportError: no sender answers at ``address``.
    """

    def __init__(
        self,
        target: WeightTarget,
        address: str,
        *,
        engine: str = "torch",
        rank: int = 0,
        receiver_id: str | None = None,
        verify_checksums: bool = True,
        connect_timeout_s: float = 10.0,
        transports: tuple[str, ...] = ("shm", "cuda_ipc"),
        connection: Connection | None = None,
    ) -> None:
        self.target = target
        self.address = address
        self.verify_checksums = verify_checksums
        self._weights = WeightsState()
        """Shared with the connection, which tells the sender in every hello (not ``self``:
        the connection must not keep this object alive, see ``_leave_finalizer``)."""
        self.last_error: WeightSyncError | None = None
        self._reader = BucketReader(
            target.device,
            chunks_in_place=target.chunks_in_place,
            verify_checksums=verify_checksums,
        )
        self._broadcast = BroadcastReceiver(target.device)
        self._manifests = ManifestCache()
        self._validated: tuple[bytes, int] | None = None
        """(manifest key, target generation) the target last accepted: the same tensor list
        for the same model need not be checked again."""
        trace.set_role("receiver")
        self._connection = connection or GrpcConnection(
            address,
            receiver_hello(
                target.device,
                engine=engine,
                rank=rank,
                receiver_id=receiver_id,
                transports=transports,
            ),
            # Joined from the connection's thread: the sender waits for every member before
            # a version's first broadcast, and must not wait for sync() to be called.
            on_join=self._broadcast.join,
            weights=self._weights,
            connect_timeout_s=connect_timeout_s,
        )
        self.receiver_id = self._connection.receiver_id
        # A receiver dropped right after sync() (a function's local, a process that exits)
        # must still deliver its last "applied": the finalizer holds the parts, not self.
        self._leave_finalizer = weakref.finalize(
            self, _leave, self._connection, self._broadcast, _LEAVE_FLUSH_S
        )

    @property
    def applied_version(self) -> int:
        """The last version applied; 0: none since this receiver started."""
        return self._weights.applied_version

    @property
    def dirty(self) -> bool:
        """True when a failed version wrote some weights: they match no version until the next."""
        return self._weights.dirty

    def _send(self, **kind: object) -> None:
        self._connection.send(pb.ReceiverMessage(**kind))

    def sync(self, timeout: float | None = None, version: int | None = None) -> int:
        """Apply the next version announced to this receiver and return it.

        Waits up to ``timeout`` seconds (None: forever) for a version to start. With
        ``version``, an earlier one still announced (its caller gave up waiting for it) is
        declined unapplied and the wait goes on.

        Raises:
            NameResolutionError, ManifestMismatchError: the manifest does not fit the model;
                nothing was written, the previous version stays.
            ChecksumError: a bucket arrived corrupted; ``dirty`` says whether weights changed.
            ReceiverFailedError: the sender gave up on this receiver for the version.
            TransportError: the sender went away.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        msg = self._connection.next(deadline, "version", in_version=False)
        while msg.WhichOneof("kind") != "start" or msg.start.manifest.version < (version or 0):
            if msg.WhichOneof("kind") == "start":
                self._decline(msg.start.manifest.version, version)
            # Else leftovers of a version already left.
            msg = self._connection.next(deadline, "version", in_version=False)
        trace.mark("receiver.start")
        version = msg.start.manifest.version
        try:
            # Parsing bounds every field too: a manifest past a bound is rejected like one
            # that does not fit the model, before any write.
            manifest, key = self._manifests(msg.start.manifest)
            self._validate(manifest, key)
        except Exception as e:
            error = as_weightsync_error(e, f"validating version {version}")
            self._send(
                verdict=pb.ManifestVerdict(
                    version=version, accepted=False, error=error_to_pb(error)
                )
            )
            self.last_error = error
            if error is e:
                raise
            raise error from e
        self._send(verdict=pb.ManifestVerdict(version=manifest.version, accepted=True))
        return self._apply(manifest)

    def _decline(self, stale: int, wanted: int | None) -> None:
        """Reject ``stale`` before any write: the sender ends it for us at once instead of
        waiting out its ack timeout."""
        error = VersionError(
            f"receiver {self.receiver_id} skipped version {stale}: its engine asked for "
            f"version {wanted} (version {stale} was given up on)"
        )
        self._send(
            verdict=pb.ManifestVerdict(version=stale, accepted=False, error=error_to_pb(error))
        )

    def _validate(self, manifest: VersionManifest, key: bytes) -> None:
        validated = (key, self.target.generation)
        if validated != self._validated:
            self.target.validate(manifest)
            self._validated = validated

    def _apply(self, manifest: VersionManifest) -> int:
        version = manifest.version
        reads = VersionReads(version)
        touched = False  # did any write reach the model? (decides `dirty` on failure)
        index = -1
        self._weights.applying = True
        try:
            self.target.begin(manifest)
            while True:
                msg = self._connection.next(None, f"bucket of version {version}", in_version=True)
                kind = msg.WhichOneof("kind")
                trace.mark(f"receiver.{kind}", index=msg.bucket.layout.index)
                if kind == "bucket":
                    index = msg.bucket.layout.index
                    with self._broadcast.reading(msg.bucket) as landed:
                        load = self._reader.prepare(msg.bucket, reads, landed)
                        touched = True
                        load.write(self.target)
                        read_event = self._reader.release(msg.bucket, load, reads)
                    trace.mark("receiver.queued", index=index)
                    self._send(
                        ack=pb.BucketAck(
                            version=version, index=index, ok=True, read_event=read_event
                        )
                    )
                elif kind == "end":
                    reads.require_complete()
                    reads.wait()
                    self._broadcast.synchronize()
                    trace.mark("receiver.loaded", version=version)
                    reads.check(msg.end)
                    self.target.commit(manifest)
                    trace.mark("receiver.committed", version=version)
                    self._send(applied=pb.VersionApplied(version=version, ok=True))
                    self._weights.applied_version, self._weights.dirty = version, False
                    self.last_error = None
                    return version
                elif kind == "abort":
                    raise ReceiverFailedError(
                        f"the sender abandoned version {version} for receiver "
                        f"{self.receiver_id}: {describe(msg.abort.reason)}"
                    )
                else:
                    raise ProtocolError(f"unexpected {kind} inside version {version}")
        except Exception as e:
            # Whatever failed (an engine's loader raises its own types too), the target rolls
            # back what it can, `dirty` says whether weights changed, and the sender hears why
            # at once instead of waiting out its ack timeout.
            where = f"version {version}" + (f", bucket {index}" if index >= 0 else "")
            error = as_weightsync_error(e, where)
            self._weights.dirty = self._weights.dirty or touched
            self.last_error = error
            try:
                self.target.abort(manifest, error)
            finally:
                if not isinstance(error, ReceiverFailedError) and not self._connection.closed:
                    self._send(
                        applied=pb.VersionApplied(
                            version=version, ok=False, error=error_to_pb(error)
                        )
                    )
            if error is e:
                raise
            raise error from e
        finally:
            self._weights.applying = False

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Deliver pending acks, then leave: ending our stream lets the sender end its side."""
        self._leave_finalizer.detach()
        _leave(self._connection, self._broadcast, flush_timeout_s)

    def __enter__(self) -> ReceiverCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
