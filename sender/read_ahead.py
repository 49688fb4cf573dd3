"""A receiver stream's messages taken off the stream one ahead of their handling.

gRPC Python's server takes a message off a stream only when the servicer asks for the next
one: a message that arrived while the sender still handled the one before it stays in gRPC's
hands, and is dropped with the call if the receiver cancels it then (it sent ``applied`` and
cancelled at once: the version failed for it as "receiver disconnected", docs/protocol.md §4).
Reading on a thread of its own, one message ahead, takes it off the stream as it arrives.
Only the gRPC part of a stream needs it: a lane's socket keeps what the receiver wrote before it
cancelled, so the sender handles lane messages on the thread that reads them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

M = TypeVar("M")

_PUT_WAIT_S = 0.1
"""How often a reader held up by a slow consumer looks whether it was stopped."""


class ReadAhead(Generic[M]):
    """Iterates ``messages`` on a thread of its own, at most one message ahead of the
    iteration over this object (a peer that floods is held by the stream's flow control, not
    buffered here). The end of ``messages``, or what it raised, comes after every message it
    gave. :meth:`stop` when done iterating: the thread then ends once ``messages`` does."""

    def __init__(self, messages: Iterator[M], name: str) -> None:
        self._items: queue.Queue = queue.Queue(maxsize=1)
        self._stopped = threading.Event()
        threading.Thread(target=self._read, args=(messages,), name=name, daemon=True).start()

    def _read(self, messages: Iterator[M]) -> None:
        try:
            for msg in messages:
                if not self._put((msg, None)):
                    return
        except BaseException as e:  # noqa: BLE001 - raised again by the consumer
            self._put((None, e))
            return
        self._put((None, None))

    def _put(self, item: tuple) -> bool:
        while not self._stopped.is_set():
            try:
                self._items.put(item, timeout=_PUT_WAIT_S)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[M]:
        while True:
            msg, error = self._items.get()
            if error is not None:
                raise error
            if msg is None:
                return
            yield msg

    def stop(self) -> None:
        """No more iteration: what the thread still reads is dropped."""
        self._stopped.set()
