"""One sender a receiver is registered with (:class:`Link`), and the helpers both the
single-sender path (:mod:`.core`) and the several-senders path (:mod:`.several_senders`) use."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.errors import WeightSyncError
from weightsync.receiver.broadcast import BroadcastReceiver
from weightsync.receiver.connection import Connection, GrpcConnection, WeightsState
from weightsync.receiver.reader import BucketReader
from weightsync.receiver.target import WeightTarget
from weightsync.v1 import weightsync_pb2 as pb


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


def open_link(
    address: str,
    hello: pb.ReceiverHello,
    connection: Connection | None,
    target: WeightTarget,
    verify_checksums: bool,
    weights: WeightsState,
    connect_timeout_s: float,
) -> Link:
    """Register with the sender at ``address`` (or use ``connection``) and make what reads
    its buckets into ``target``'s device."""
    broadcast = BroadcastReceiver(target.device)
    if connection is None:
        own = pb.ReceiverHello()
        own.CopyFrom(hello)  # each connection fills in its own registration
        connection = GrpcConnection(
            address,
            own,
            # Joined from the connection's thread: the sender waits for every member
            # before a version's first broadcast, and must not wait for sync().
            on_join=broadcast.join,
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
