"""A publisher rank's ``Publish`` stream, kept across its versions, and the deadline of each."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable

import torch

from weightsync.control.lanes import ClientStream
from weightsync.stream_keys import SentKeys
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import manifest_key


class PublishStream(ClientStream):
    """A Publish stream: the messages this publisher sends and the sender's replies."""

    def __init__(self, stub, hello: pb.PublisherHello, device: torch.device) -> None:
        super().__init__(stub.Publish, pb.PublisherMessage(hello=hello), pb.SenderReply)
        self.device = device
        self._lanes = hello.lanes
        """Where the tensors it publishes live (the hello says it; another needs a new stream)."""
        self.watchdog = Watchdog(self.cancel)
        """Cancels the replies when a version's deadline passes."""
        self.begins_sent = SentKeys()
        """The begin keys the sender holds for this stream (it keeps them: ``begin_keys``)."""
        self._keyed: tuple[Whole, bytes] | None = None
        """The last begin's contents keyed, and their key."""
        self.welcomed = False
        self.waits_ready = False
        """The sender waits for ``SourcePiece.ready`` events (its welcome said so)."""

    def welcome(self, welcome: pb.PublisherWelcome) -> None:
        """The sender's welcome: take the lane it offers, if any."""
        self.welcomed, self.begins_sent.peer_keeps = True, welcome.begin_keys
        self.waits_ready = welcome.ready_events
        if welcome.HasField("lane"):
            self.take_lane(welcome.lane)

    def key_of(self, whole: Whole) -> bytes:
        """The ``begin_key`` of ``whole``: worked out again only for other contents."""
        if self._keyed is None or not same_begin(self._keyed[0], whole):
            self._keyed = (whole, begin_key(whole))
        return self._keyed[1]

    def await_welcome(self) -> None:
        """Read the welcome before the first begin, which then goes by the lane (only a lane
        carries the descriptors of offered shm files). A stream that ends first ends the
        replies too."""
        if self.welcomed:
            return
        for reply in self.replies:
            if reply.WhichOneof("kind") == "welcome":
                self.welcome(reply.welcome)
                return

    def send_begin(self, begin: pb.BeginVersion) -> None:
        """Send ``begin`` with the open descriptors of the shm files it offers, on the lane
        (the sender maps only memory whose descriptor a publisher passes, and has the rest
        packed through ``pack``): the first begin waits for the welcome for that."""
        paths = [h.shm.path for h in begin.sources if h.HasField("shm")]
        if not (paths and self._lanes):
            self.send(pb.PublisherMessage(begin=begin))
            return
        self.await_welcome()
        fds: list[int] = []
        try:
            try:
                for path in paths:
                    fds.append(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
            except OSError:
                pass  # unlinked since: then it goes without, and the sender asks for packing
            self.send(pb.PublisherMessage(begin=begin), fds if len(fds) == len(paths) else ())
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        self.end()
        self.cancel()
        self.watchdog.close()


class Watchdog:
    """Calls ``expire`` once an armed deadline passes before it is disarmed. One thread for
    every version of a stream, where a ``threading.Timer`` per version started a thread on
    each version's latency path (while the stream's own threads need the GIL)."""

    def __init__(self, expire: Callable[[], object]) -> None:
        self._expire = expire
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._expired = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def arm(self, timeout_s: float) -> threading.Event:
        """Start the clock; the event returned is set if it runs out."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="deadline", daemon=True)
                self._thread.start()
            self._expired = threading.Event()
            self._deadline = time.monotonic() + timeout_s
            self._cond.notify()
            return self._expired

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                left = None if self._deadline is None else self._deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._deadline = None
                    self._expired.set()
                    self._expire()
                else:
                    self._cond.wait(left)


Whole = tuple[pb.Manifest, pb.BeginVersion | None, bool]
"""What a whole begin carries: the wire manifest (any version), the offer, allow_direct."""


def same_begin(a: Whole, b: Whole) -> bool:
    """The same begin but its version: the cached wire messages are the same objects."""
    return a[0] is b[0] and a[1] is b[1] and a[2] == b[2]


def begin_key(whole: Whole) -> bytes:
    """A digest of a begin's contents: its manifest but the version (by ``manifest_key``), its
    offer and allow_direct. Equal contents, equal keys, whatever objects hold them."""
    manifest, offer, direct = whole
    digest = hashlib.blake2b(manifest_key(manifest), digest_size=16)
    digest.update(b"" if offer is None else offer.SerializeToString(deterministic=True))
    digest.update(bytes([direct]))
    return digest.digest()
