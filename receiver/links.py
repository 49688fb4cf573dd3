"""One sender a receiver is registered with (:class:`Link`), and the helpers both the
single-sender path (:mod:`.core`) and the several-senders path (:mod:`.several_senders`) use."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from weightsync.errors import ReceiverFailedError, SyncTimeoutError, VersionError, WeightSyncError
from weightsync.receiver.connection import Connection, GrpcConnection, Keeps, WeightsState
from weightsync.receiver.exports import Exporter
from weightsync.receiver.reader import BucketReader
from weightsync.receiver.target import WeightTarget
from weightsync.transports.broadcast import BroadcastReceiver
from weightsync.transports.cuda_ipc import QueuedWork
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import describe, error_to_pb

log = logging.getLogger("weightsync.receiver")


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

    # What the connection's stream sent by key is the connection's (``Connection.kept``):
    # these three are the only ways in.

    def bucket(self, announced: pb.BucketAnnouncement) -> pb.BucketAnnouncement:
        """The announcement with ``announced``'s layout and sources (for one sent by key
        alone, the kept one, of an earlier version: take the version from ``announced``).

        Raises:
            ProtocolError: the stream holds no layout of that key (the one it came on ended).
        """
        return self.connection.kept.bucket(announced)

    def manifest(self, start: pb.VersionStart) -> pb.Manifest:
        """``start``'s manifest with its tensors (the stream's copy, for one sent by key).

        Raises:
            ProtocolError: the stream holds no manifest of that key.
        """
        return self.connection.kept.manifest(start)

    def verdict(
        self,
        version: int,
        error: WeightSyncError | None,
        keeps: Keeps | None = None,
        writes: pb.WriteOffer | None = None,
    ) -> None:
        """Accept ``version`` (declaring ``keeps``, by key alone once this stream sent them;
        letting the sender write it into the memory of ``writes``, sent first unless this
        stream sent it) or refuse it with ``error``."""
        verdict = pb.ManifestVerdict(version=version, accepted=error is None)
        if error is not None:
            verdict.error.CopyFrom(error_to_pb(error))
        elif keeps is not None:
            self.connection.kept.declare(verdict, keeps)
        if error is None and writes is not None:
            first = self.connection.kept.offer(verdict, writes)
            if first is not None:
                self.connection.send(pb.ReceiverMessage(offer=first))
        self.connection.send(pb.ReceiverMessage(verdict=verdict))


def open_link(
    address: str,
    hello: pb.ReceiverHello,
    connection: Connection | None,
    target: WeightTarget,
    verify_checksums: bool,
    weights: WeightsState,
    connect_timeout_s: float,
    exporter: Exporter | None = None,
    delta_bytes: int = 0,
) -> Link:
    """Register with the sender at ``address`` (or use ``connection``) and make what reads
    its buckets into ``target``'s device (keeping ``delta_bytes`` of them for deltas)."""
    broadcast = BroadcastReceiver(target.device, delta_bytes)
    if connection is None:
        own = pb.ReceiverHello()
        own.CopyFrom(hello)  # each connection fills in its own registration
        connection = GrpcConnection(
            address,
            own,
            # Joined from the connection's thread: the sender waits for every member
            # before a version's first broadcast, and must not wait for sync().
            on_join=broadcast.join,
            on_export=exporter,
            weights=weights,
            connect_timeout_s=connect_timeout_s,
        )
    reader = BucketReader(
        target.device, chunks_in_place=target.chunks_in_place, verify_checksums=verify_checksums
    )
    return Link(address, connection, broadcast, reader)


def leave(links: list[Link], flush_timeout_s: float) -> None:
    for link in links:
        if not link.connection.closed:
            link.connection.close(flush_timeout_s)
            link.broadcast.close()


def as_weightsync_error(error: BaseException, where: str) -> WeightSyncError:
    """``error`` itself when it is a WeightSyncError, else one saying where and what."""
    if isinstance(error, WeightSyncError):
        return error
    return WeightSyncError(f"{where}: {type(error).__name__}: {error}")


def in_hand(link: Link, waiting_for: str, within_s: float = 0.0) -> pb.Announcement | None:
    """The sender's next announcement if it arrived already (or ``within_s``), else None."""
    try:
        return link.connection.next(time.monotonic() + within_s, waiting_for, in_version=True)
    except SyncTimeoutError:
        return None


def ack_once_read(link: Link, ack: pb.BucketAck, reads: QueuedWork | None) -> None:
    """Send ``ack`` once its bucket's ``reads`` (if any) are done."""
    if reads is not None:
        reads.wait()
    link.connection.send(pb.ReceiverMessage(ack=ack))


def ack_or_fold(link: Link, ack: pb.BucketAck, nxt: pb.Announcement | None) -> pb.BucketAck | None:
    """Send ``ack`` now; or, where its sender takes acks in applied, the bucket's reads are
    done (no ``read_event``: a slot read on the GPU frees sooner by its event) and the next
    announcement, here already, is the version's end (the commit comes next, nothing read
    before it), return it to go with the applied (``VersionApplied.acks``: one message, not
    two)."""
    ends = nxt is not None and nxt.WhichOneof("kind") == "end"
    if ends and link.connection.kept.acks_in_applied and not ack.read_event:
        return ack
    link.connection.send(pb.ReceiverMessage(ack=ack))
    return None


_LOOK_S = 50e-6
"""How long :class:`HeldAcks` waits for the next announcement at a time before it looks
whether the reads are done (an arrival ends the wait at once)."""


class HeldAcks:
    """A bucket's ack held while its reads still run, where it cannot carry a read event (a
    CUDA buffer read into host memory, buffers on several GPUs, an announcement without a
    packed event; the sender reuses the buffer once acked): the next bucket, arriving while
    they run, has its copies queued first, so the GPU does not idle between the two while
    this process waits and acks."""

    def __init__(self, link: Link) -> None:
        self._link = link
        self._held: tuple[pb.BucketAck, QueuedWork] | None = None

    def after(
        self, ack: pb.BucketAck, reads: QueuedWork | None, waiting_for: str
    ) -> tuple[pb.BucketAck | None, pb.Announcement | None]:
        """``ack``'s bucket is launched: the ack held before goes once its reads are done.
        Returns this ack where it goes with the applied (:func:`ack_or_fold`), and the
        sender's next announcement where it came before this bucket's ``reads`` were done
        (else None: the caller waits for it). This ack is held when that is a bucket, else it
        goes once the reads are done."""
        self.flush()
        if reads is not None:
            self._held = (ack, reads)  # a failure while looking still waits for the reads
        nxt = in_hand(self._link, waiting_for)
        while nxt is None and reads is not None and not reads.done():
            nxt = in_hand(self._link, waiting_for, _LOOK_S)
        if reads is not None and nxt is not None and nxt.WhichOneof("kind") == "bucket":
            return None, nxt
        self._held = None
        if reads is not None:
            reads.wait()
        return ack_or_fold(self._link, ack, nxt), nxt

    def flush(self) -> None:
        """Wait for the held ack's reads and send it."""
        if self._held is not None:
            (ack, reads), self._held = self._held, None
            ack_once_read(self._link, ack, reads)

    def abandon(self, send: bool) -> None:
        """The version failed here: the held reads end before the target rolls back, and
        their ack goes where ``send``. Raises nothing: the failure being handled must reach
        the sender and the caller (a wait that fails means the GPU is in error, which the
        next use of it reports)."""
        if self._held is not None:
            (ack, reads), self._held = self._held, None
            try:
                if send:
                    ack_once_read(self._link, ack, reads)
                else:
                    reads.wait()
            except Exception:
                log.warning("a failed version's held reads did not end cleanly", exc_info=True)


def decline(link: Link, receiver_id: str, stale: int, wanted: int | None) -> None:
    """Reject ``stale`` before any write: the sender ends it for us at once instead of waiting
    out its ack timeout."""
    error = VersionError(
        f"receiver {receiver_id} skipped version {stale}: its engine asked for version "
        f"{wanted} (version {stale} was given up on)"
    )
    link.verdict(stale, error)


def abandoned(receiver_id: str, version: int, abort: pb.VersionAbort) -> ReceiverFailedError:
    """The error of a version the sender gave up on for this receiver."""
    return ReceiverFailedError(
        f"the sender abandoned version {version} for receiver {receiver_id}: "
        f"{describe(abort.reason)}"
    )
