"""What the two ends of a Receive stream keep by key: direct layouts (``layout_key``) and
manifests (``manifest_key``) the sender sent once with their contents and later as their key
alone.

Both ends follow one rule, so they forget at the same moment: a stream keeps at most
:data:`KEYS_KEPT` of each, and sending (on the sender) or receiving (on the receiver) contents
under a new key when that many are kept forgets them all first. Messages arrive in the order
they were sent, so a key sent alone is one the receiver still holds.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

KEYS_KEPT = 16

V = TypeVar("V")


class SentKeys:
    """The sender's side: which keys this stream's receiver holds."""

    def __init__(self) -> None:
        self._sent: set[Hashable] = set()

    def needs(self, key: Hashable) -> bool:
        """True when the contents must go with ``key`` (then counted as held from now on)."""
        if key in self._sent:
            return False
        if len(self._sent) >= KEYS_KEPT:
            self._sent.clear()
        self._sent.add(key)
        return True

    def __contains__(self, key: Hashable) -> bool:
        return key in self._sent


class KeptByKey(Generic[V]):
    """The receiver's side: the contents of each key this stream sent."""

    def __init__(self) -> None:
        self._known: dict[Hashable, V] = {}

    def keep(self, key: Hashable, value: V) -> None:
        if key not in self._known and len(self._known) >= KEYS_KEPT:
            self._known.clear()
        self._known[key] = value

    def get(self, key: Hashable) -> V | None:
        return self._known.get(key)
