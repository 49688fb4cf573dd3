"""A stream's outgoing messages, queued for the stream's own thread or, on a lane, written by
whichever thread sends them.

Before its lane, a stream's thread takes each message from the queue and yields it to gRPC.
On a lane that thread was one more handoff per message (about 0.2 ms: the thread that queued
a version's start, or a publisher's ``staged``, wakes another to write it). So once the stream
is on its lane and nothing is left queued (:meth:`Outbox.direct`), :meth:`Outbox.put` writes
each message itself, without blocking: the sender's lock may be held. What does not fit the
socket at once is queued (the rest of its frame first) and the stream's thread writes it;
sentinels (the stream's end, an error to end it with) always go by the queue, behind every
message written before them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from google.protobuf.message import Message

from weightsync import trace
from weightsync.control.lanes import Lane, LaneClosed
from weightsync.v1 import weightsync_pb2 as pb


class Unsent(bytes):
    """The rest of a frame the socket did not take at once: the stream's thread writes it
    before anything queued behind it."""


def batched(item: pb.Announcement | list[pb.Announcement]) -> pb.Announcement:
    """A receiver's announcements sent together (``Outcomes.together``) as one message."""
    if isinstance(item, Message):
        return item
    if len(item) == 1:
        return item[0]
    msg = pb.Announcement()
    msg.batch.items.extend(item)  # one copy of each (a nested constructor makes two)
    return msg


class Outbox(queue.Queue):
    """A stream's outgoing messages (see the module docstring). ``framed`` turns what was
    put (a message, or a list of them sent together) into the one message to write."""

    def __init__(self, framed: Callable[[object], Message] = lambda m: m) -> None:
        super().__init__()
        self._framed = framed
        self._lane: Lane | None = None
        self._order = threading.Lock()
        """Held while deciding whether a message is written at once or queued."""

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        if not isinstance(item, (Message, list)):
            super().put(item, block, timeout)
            return
        with self._order:
            if self._lane is not None:
                msg = self._framed(item)
                try:
                    rest = self._lane.try_send(msg)
                except LaneClosed:
                    self._lane = None  # the stream's thread finds it closed and ends
                else:
                    if rest is None:
                        if trace.enabled:
                            trace.mark("sender.lane_write", kind=msg.WhichOneof("kind"))
                        return
                    self._lane, item = None, Unsent(rest)
            super().put(item, block, timeout)

    def direct(self, lane: Lane) -> None:
        """The stream is on ``lane`` and its thread wrote all it took: later messages are
        written by their senders, once nothing is queued (else it asks again after those)."""
        with self._order:
            if self.empty():
                self._lane = lane

    def queued(self) -> None:
        """Back to the stream's thread for every message (its lane is going away)."""
        with self._order:
            self._lane = None
