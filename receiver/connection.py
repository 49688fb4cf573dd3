"""The receiver's connection to its sender: register, pump announcements, register again.

:class:`GrpcConnection` is the real one; :class:`ReceiverCore` takes any :class:`Connection`,
so its version state machine can be driven by an in-memory one.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import grpc
import torch

from weightsync import trace
from weightsync.config import ClientSettings
from weightsync.control.client import connect
from weightsync.control.lanes import ClientStream
from weightsync.errors import ProtocolError, TransportError
from weightsync.receiver.inbox import Inbox
from weightsync.stream_keys import KeptByKey, SentKeys, unknown_key
from weightsync.transports.broadcast import host_id
from weightsync.transports.cuda_ipc import device_uuid
from weightsync.v1 import weightsync_pb2 as pb

log = logging.getLogger("weightsync.receiver")


class Connection(Protocol):
    """What the version state machine needs of its link to the sender."""

    @property
    def receiver_id(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def next(
        self, deadline: float | None, waiting_for: str, in_version: bool
    ) -> pb.Announcement: ...

    def send(self, message: pb.ReceiverMessage) -> None: ...

    def close(self, flush_timeout_s: float) -> None: ...

    @property
    def kept(self) -> KeptByStream:
        """What the current stream sent by key (contents of announcements sent by key alone)."""
        ...


@dataclass
class WeightsState:
    """What a receiver's weights are, told to the sender in every hello: the sender's Status
    takes it from the receiver, never from an earlier registration of the same id."""

    applied_version: int = 0
    dirty: bool = False
    """A version failed after writing some weights: they match no version until the next."""
    applying: bool = False
    """A version is being written: how it ends (applied or dirty) is not known yet."""


class KeptByStream:
    """What one stream sends by key (``weightsync/stream_keys.py``), on the receiver's side:
    the direct layouts and manifests the sender announced, by ``layout_key`` and
    ``manifest_key`` (the hello said ``layout_keys`` and ``manifest_keys``), and the keys of
    the boxes this receiver declared (:meth:`declare`).
    One announced again by its key alone stays so: the core takes its contents from here
    when it needs them (copying 4,719 layout entries into every version's announcement cost
    a millisecond on the path before the copies start)."""

    def __init__(
        self, keeps_keys: bool = False, takes_writes: bool = False, acks_in_applied: bool = False
    ) -> None:
        self._layouts: KeptByKey[pb.BucketAnnouncement] = KeptByKey("layout_key")
        self._manifests: KeptByKey[pb.Manifest] = KeptByKey("manifest_key")
        self._keeps_sent = SentKeys()
        self._keeps_sent.peer_keeps = keeps_keys  # the sender's welcome said ``keeps_keys``
        self.takes_writes = takes_writes
        """The sender's welcome said ``takes_writes``: it may write our weights (§4.3)."""
        self._offers_sent = SentKeys()
        self._offers_sent.peer_keeps = takes_writes
        self.acks_in_applied = acks_in_applied
        """The sender's welcome said ``acks_in_applied``: the last acks may go with applied."""

    def declare(self, verdict: pb.ManifestVerdict, keeps: Keeps) -> None:
        """Put ``keeps`` into ``verdict`` under their key, or the key alone once the sender
        holds it (no boxes: every tensor whole, no key)."""
        if not keeps.boxes:
            return
        verdict.keeps_key = keeps.key
        if not self._keeps_sent.alone(keeps.key):
            verdict.keeps.extend(keeps.boxes)

    def offer(self, verdict: pb.ManifestVerdict, offer: pb.WriteOffer) -> pb.WriteOffer | None:
        """Name ``offer`` in ``verdict`` (``writes_key``) for a sender that takes writes;
        returns it when it must go before the verdict (not sent on this stream yet)."""
        if not self.takes_writes:
            return None
        verdict.writes_key = offer.key
        return None if self._offers_sent.alone(offer.key) else offer

    def complete(self, msg: pb.Announcement) -> pb.Announcement:
        """Keep what ``msg`` sends with its key; ``msg`` itself, or an abort of its version
        for a bucket whose layout key this stream never sent (a sender bug: the version fails
        here). A start whose manifest key is unknown goes on: the core refuses it in its
        verdict, naming the key (:meth:`manifest`)."""
        kind = msg.WhichOneof("kind")
        if kind == "bucket" and msg.bucket.layout_key:
            bucket = msg.bucket
            if bucket.HasField("layout"):
                self._layouts.keep(bucket.layout_key, bucket)
            elif self._layouts.get(bucket.layout_key) is None:
                reason = pb.ErrorDetail(
                    code="ProtocolError",
                    message=unknown_key(_bucket(bucket), "layout_key", bucket.layout_key),
                )
                return pb.Announcement(abort=pb.VersionAbort(version=bucket.version, reason=reason))
        elif kind == "start" and msg.start.manifest_key and msg.start.manifest.tensors:
            # A manifest is never empty (both ends refuse one): no tensors is by key alone.
            self._manifests.keep(msg.start.manifest_key, msg.start.manifest)
        return msg

    def bucket(self, bucket: pb.BucketAnnouncement) -> pb.BucketAnnouncement:
        """The announcement with ``bucket``'s layout and sources: itself, or for one sent by
        key alone the kept one (of an earlier version: take the version from ``bucket``).

        Raises:
            ProtocolError: the stream holds no layout of that key.
        """
        if not bucket.layout_key or bucket.HasField("layout"):
            return bucket
        return self._layouts.held(bucket.layout_key, _bucket(bucket))

    def manifest(self, start: pb.VersionStart) -> pb.Manifest:
        """``start``'s manifest with its tensors (a copy of the kept one, for one sent by key
        alone).

        Raises:
            ProtocolError: this stream holds no manifest of that key.
        """
        if not start.manifest_key or start.manifest.tensors:
            return start.manifest
        version = start.manifest.version
        known = self._manifests.held(start.manifest_key, f"version {version}: a start")
        manifest = pb.Manifest()
        manifest.CopyFrom(known)
        manifest.version = version
        return manifest


class Keeps(NamedTuple):
    """The boxes a verdict declares, and their ``keeps_key``: equal keys, equal boxes."""

    boxes: list[pb.TensorBox]
    key: bytes


def _bucket(bucket: pb.BucketAnnouncement) -> str:
    return f"version {bucket.version}: a bucket"


def _items(msg: pb.Announcement) -> Iterator[pb.Announcement]:
    """``msg``, or the announcements of a batch in order."""
    if msg.WhichOneof("kind") == "batch":
        for item in msg.batch.items:
            yield from _items(item)
    else:
        yield msg


def receiver_hello(
    device: torch.device,
    *,
    engine: str,
    rank: int,
    receiver_id: str | None,
    transports: tuple[str, ...],
    exports: bool = False,
) -> pb.ReceiverHello:
    """How a receiver on ``device`` introduces itself (default id: engine, pid, random); the
    connection fills in its :class:`WeightsState` at each registration."""
    return pb.ReceiverHello(
        receiver_id=receiver_id or f"{engine}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
        engine=engine,
        rank=rank,
        device=str(device),
        device_uuid=device_uuid(device),
        transports=list(transports),
        host_id=host_id(),
        layout_keys=True,
        manifest_keys=True,
        batches=True,
        lanes=ClientSettings().lanes,
        exports=exports,
    )


class GrpcConnection:
    """A Receive stream to the sender at ``address``, registered in the constructor.

    A pump thread moves announcements to the inbox and hands broadcast group joins to
    ``on_join`` and catch-up exports to ``on_export`` at once (the sender waits for them, not
    for ``sync()``). When the sender
    goes away it queues :class:`SenderLost` and registers again by the same id, backing off,
    once no version is being written: every hello says what ``weights`` are.

    Raises:
        TransportError: no sender answers at ``address``, or it refused the registration.
    """

    def __init__(
        self,
        address: str,
        hello: pb.ReceiverHello,
        *,
        on_join: Callable[[pb.GroupJoin], None],
        on_export: Callable[[pb.PackBucket], pb.BucketExported] | None = None,
        weights: WeightsState | None = None,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.address = address
        self._hello = hello
        self._weights = weights or WeightsState()
        self._on_join, self._on_export = on_join, on_export
        self._connect_timeout_s = connect_timeout_s
        self._closed = threading.Event()
        self._channel: grpc.Channel | None = None
        self._stream: ClientStream | None = None
        self._register(connect_timeout_s)
        self._inbox = Inbox(self.receiver_id, address)
        self.kept = KeptByStream()
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    @property
    def receiver_id(self) -> str:
        """The id the sender welcomed this receiver by."""
        return self._hello.receiver_id

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _register(self, timeout_s: float) -> None:
        """Open a Receive stream and register (again, after a sender restart, by the same id)."""
        channel, stub = connect(self.address, timeout_s)
        self._hello.applied_version = self._weights.applied_version
        self._hello.dirty = self._weights.dirty
        stream = ClientStream(stub.Receive, pb.ReceiverMessage(hello=self._hello), pb.Announcement)
        try:
            first = next(stream.replies)
        except grpc.RpcError as e:
            channel.close()
            raise TransportError(
                f"register with the sender at {self.address}: {e.details()}"
            ) from None
        self._hello.receiver_id = first.welcome.receiver_id
        self._welcome = first.welcome
        if first.welcome.HasField("lane"):
            stream.take_lane(first.welcome.lane)
        old, old_stream = self._channel, self._stream
        self._channel, self._stream = channel, stream
        if old_stream is not None:
            old_stream.cancel()
        if old is not None:
            old.close()

    def _pump(self) -> None:
        backoff_s = 0.5
        while True:
            # The sender's record of what it sent is per stream too.
            welcome = self._welcome
            kept = self.kept = KeptByStream(
                welcome.keeps_keys, welcome.takes_writes, welcome.acks_in_applied
            )
            try:
                for msg in self._stream.replies:
                    for item in _items(msg):
                        trace.mark("receiver.arrived", kind=item.WhichOneof("kind"))
                        if item.WhichOneof("kind") == "join":
                            self._on_join(item.join)
                        elif item.WhichOneof("kind") == "export":
                            self._export(item.export)
                        else:
                            self._inbox.put(kept.complete(item))
                reason = "the sender ended the stream"
            except grpc.RpcError as e:
                reason = e.details() or str(e.code())
                if e.code() == grpc.StatusCode.ALREADY_EXISTS:
                    log.error("receiver %s: %s", self.receiver_id, reason)
                    self._inbox.sender_lost(reason, replaced=True)
                    return  # registering again would take the id back: two would flap
            except ProtocolError as e:
                reason = str(e)
            if self._closed.is_set():
                return
            self._inbox.sender_lost(reason)
            log.warning(
                "receiver %s lost the sender at %s (%s); registering again",
                self.receiver_id,
                self.address,
                reason,
            )
            while not self._closed.wait(backoff_s):
                if self._weights.applying:
                    # The version in flight fails on the SenderLost queued above; register
                    # after that, so the hello says whether it left the weights dirty.
                    continue
                try:
                    # Short tries: close() must find this thread between them, not inside
                    # a channel being set up (left there at exit, gRPC aborts the process).
                    self._register(min(self._connect_timeout_s, 1.0))
                    break
                except TransportError:
                    backoff_s = min(backoff_s * 2, 5.0)
            else:
                return
            backoff_s = 0.5
            log.warning("receiver %s registered again at %s", self.receiver_id, self.address)

    def _export(self, export: pb.PackBucket) -> None:
        if self._on_export is None:
            error = pb.ErrorDetail(code="ProtocolError", message="this receiver does not export")
            reply = pb.BucketExported(
                version=export.version, index=export.layout.index, error=error
            )
        else:
            reply = self._on_export(export)
        self.send(pb.ReceiverMessage(exported=reply))

    def next(self, deadline: float | None, waiting_for: str, in_version: bool) -> pb.Announcement:
        return self._inbox.next(deadline, waiting_for, in_version)

    def send(self, message: pb.ReceiverMessage) -> None:
        """Queue ``message`` on the stream (delivered in order, also across ``close``)."""
        if self._closed.is_set():
            raise ProtocolError(f"receiver {self.receiver_id} is closed")
        self._stream.send(message)

    def close(self, flush_timeout_s: float) -> None:
        """Deliver what was sent, then leave: ending our stream lets the sender end its side."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._stream.end()
        # A receiver dropped unclosed is closed by its finalizer, which the garbage collector
        # may run on the pump thread itself: that thread cannot wait for itself.
        if threading.current_thread() is not self._pump_thread:
            self._pump_thread.join(flush_timeout_s)
        self._stream.cancel()
        self._channel.close()
