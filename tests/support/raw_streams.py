"""Raw Publish and Receive streams driven message by message, as a hostile or non-weightsync
client would; and what a test checks the sender kept after such a client left.

Channels come from ``weightsync.control.client.connect``, so whatever credentials the clients
need apply here too.
"""

from __future__ import annotations

import queue
import threading

import grpc

from tests.support.waiting import wait_until
from weightsync.control.client import connect
from weightsync.control.lanes import connect_lane, switched
from weightsync.receiver.connection import KeptByStream
from weightsync.receiver.inbox import Inbox, SenderLost
from weightsync.v1 import weightsync_pb2 as pb

Outcome = tuple[list[str], grpc.StatusCode, str]
"""The reply kinds a stream got, then its status code and details."""


_MESSAGES = {
    "Publish": (pb.PublisherMessage, pb.SenderReply),
    "Receive": (pb.ReceiverMessage, pb.Announcement),
}


class RawStream:
    """A stream whose requests the test queues one by one; ``outcome()`` reads the replies.
    A hello saying ``lanes`` makes it take the lane its welcome offers (:meth:`first`), as
    weightsync's clients do: messages sent after that go by the lane."""

    def __init__(self, address: str, call: str, first, timeout_s: float = 15, stub=None) -> None:
        # A stub passed in is shared (closing a channel costs gRPC about 0.2 s).
        self.channel = None
        if stub is None:
            self.channel, stub = connect(address, 10)
        self.requests: queue.Queue = queue.Queue()
        if first is not None:
            self.requests.put(first)
        self._message, reply = _MESSAGES[call]
        self.call = getattr(stub, call)(iter(self.requests.get, None), timeout=timeout_s)
        self.lane = None
        self.replies = switched(self.call, lambda: self.lane, reply)

    def send(self, msg) -> None:
        if self.lane is None:
            self.requests.put(msg)
        else:
            self.lane.send(msg)

    def outcome(self, on_reply=None) -> Outcome:
        """Read until the stream ends; ``on_reply(reply)`` may answer each."""
        kinds = []
        try:
            for reply in self.replies:
                kinds.append(reply.WhichOneof("kind"))
                if on_reply is not None:
                    on_reply(reply)
        except grpc.RpcError as e:
            return kinds, e.code(), e.details()
        finally:
            self.requests.put(None)
        return kinds, grpc.StatusCode.OK, ""

    def first(self) -> str:
        """The kind of the first reply (the welcome); takes the lane it offers."""
        reply = next(self.replies)
        kind = reply.WhichOneof("kind")
        if kind == "welcome" and reply.welcome.HasField("lane"):
            self.lane = connect_lane(reply.welcome.lane)
            assert self.lane is not None, "the lane offered could not be taken"
            self.requests.put(self._message(lane=pb.LaneSwitch()))
        return kind

    def close(self) -> None:
        self.requests.put(None)
        self.call.cancel()
        if self.lane is not None:
            self.lane.close()
        if self.channel is not None:
            self.channel.close()


def raw_publisher(address: str, stub=None, **hello) -> RawStream:
    hello = {"publisher_id": "raw", "device": "cpu"} | hello
    first = pb.PublisherMessage(hello=pb.PublisherHello(**hello))
    return RawStream(address, "Publish", first, stub=stub)


def raw_receiver(address: str, stub=None, **hello) -> RawStream:
    hello = {"receiver_id": "raw", "engine": "raw", "device": "cpu"} | hello
    first = pb.ReceiverMessage(hello=pb.ReceiverHello(**hello))
    return RawStream(address, "Receive", first, stub=stub)


def begin(version: int, tensors=None, **fields) -> pb.PublisherMessage:
    tensors = (
        tensors if tensors is not None else [pb.TensorSpec(name="w", dtype="float32", shape=[4])]
    )
    manifest = fields.pop("manifest", None) or pb.Manifest(version=version, tensors=tensors)
    return pb.PublisherMessage(begin=pb.BeginVersion(manifest=manifest, **fields))


def status_within(address: str, timeout_s: float = 2.0) -> pb.StatusReply:
    """Status over a fresh channel; fails the test if the sender does not answer in time."""
    channel, stub = connect(address, 10)
    with channel:
        return stub.Status(pb.StatusRequest(), timeout=timeout_s)


def stream_threads() -> set[threading.Thread]:
    """Threads the sender starts per stream and per version (unnamed: ``Thread-N``)."""
    return {t for t in threading.enumerate() if t.name.startswith("Thread-")}


def assert_no_threads_left(before: set[threading.Thread], timeout_s: float = 10) -> None:
    wait_until(
        lambda: stream_threads() <= before,
        timeout_s,
        "the hostile streams' threads to end",
    )


def assert_nothing_joining(sender) -> None:
    co = sender.coordinator
    wait_until(lambda: not co._joining, 10, "no version left joining")


class MemoryConnection:
    """A receiver's connection whose announcements the test queues and whose sends are kept
    (``ReceiverCore(..., connection=...)``): announcements no real sender would send."""

    receiver_id = "memory"

    def __init__(self) -> None:
        self.inbox = Inbox(self.receiver_id, "memory:")
        self.sent: list[pb.ReceiverMessage] = []
        self.closed = False
        self.kept = KeptByStream()

    def announce(self, *items: pb.Announcement | SenderLost) -> None:
        for item in items:
            self.inbox.put(self.kept.complete(item) if isinstance(item, pb.Announcement) else item)

    def next(self, deadline: float | None, waiting_for: str, in_version: bool) -> pb.Announcement:
        return self.inbox.next(deadline, waiting_for, in_version)

    def send(self, message: pb.ReceiverMessage) -> None:
        self.sent.append(message)

    def close(self, flush_timeout_s: float) -> None:
        self.closed = True

    def kinds(self) -> list[str]:
        return [m.WhichOneof("kind") for m in self.sent]
