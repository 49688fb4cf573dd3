"""A receiver's inbox: the sender's announcements in arrival order, and where the stream to
the sender broke in between (:class:`SenderLost`)."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

from weightsync.errors import ReplacedError, SyncTimeoutError, TransportError
from weightsync.v1 import weightsync_pb2 as pb


@dataclass(frozen=True)
class SenderLost:
    """Queued in the inbox, between announcements, where the stream to the sender broke."""

    reason: str
    replaced: bool = False
    """Another connection registered this receiver's id: the sender will not take this one
    back, and every later wait says so at once."""


class Inbox:
    """Announcements in arrival order, and where the sender went away in between.

    Losing the sender fails a version in flight; between versions it only delays the next
    one (the connection registers again).
    """

    def __init__(self, receiver_id: str, address: str) -> None:
        self.receiver_id, self.address = receiver_id, address
        self._queue: queue.Queue[pb.Announcement | SenderLost] = queue.Queue()
        self._lost = False
        """The last thing queued was a SenderLost: say so when nothing arrives in time."""

    def put(self, item: pb.Announcement | SenderLost) -> None:
        self._queue.put(item)

    def sender_lost(self, reason: str, replaced: bool = False) -> None:
        """The stream broke: what it still queued is dropped, then :class:`SenderLost`.

        Those announcements belong to versions that can no longer finish; read later (a
        ``sync()`` long after), they would write weights behind the back of the hello that
        registered again meanwhile.
        """
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        self._queue.put(SenderLost(reason, replaced))

    def next(self, deadline: float | None, waiting_for: str, in_version: bool) -> pb.Announcement:
        """The next announcement, by ``deadline`` (monotonic; None: wait forever).

        Raises:
            SyncTimeoutError: nothing by the deadline.
            TransportError: the sender went away while ``in_version``.
        """
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                item = self._queue.get(timeout=left)
            except queue.Empty:
                raise SyncTimeoutError(
                    f"receiver {self.receiver_id}: no {waiting_for} in time"
                    + (f" (the sender at {self.address} is gone)" if self._lost else "")
                ) from None
            if not isinstance(item, SenderLost):
                self._lost = False
                return item
            self._lost = True
            if item.replaced:
                self._queue.put(item)  # for good: every later wait says so too
                raise ReplacedError(
                    f"receiver {self.receiver_id} at {self.address}: {item.reason}. Close it: "
                    "the receiver that registered this id now gets the versions"
                )
            if in_version:
                raise TransportError(
                    f"receiver {self.receiver_id}: lost the sender at {self.address} during "
                    f"a version: {item.reason}"
                )
