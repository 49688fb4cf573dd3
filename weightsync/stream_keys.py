"""One key scheme for everything a stream sends once with its contents and then by key alone
(docs/protocol.md §2.1): a publisher's begins (``BeginVersion.begin_key``), the sender's
manifests (``VersionStart.manifest_key``) and direct layouts (``BucketAnnouncement.layout_key``),
a receiver's boxes (``ManifestVerdict.keeps_key``).

The side that keeps a kind says ``<kind>_keys`` in its hello or welcome; only then does its peer
leave contents out. Both ends follow one rule, so they forget at the same moment: a stream
keeps at most :data:`KEYS_KEPT` keys of each kind, and sending (the contents' sender) or
receiving (the keeper) contents under a new key when that many are kept forgets them all
first. Messages arrive in the order they were sent, so a key sent alone is one the keeper still
holds. A new stream starts empty on both ends.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from weightsync.errors import ProtocolError

KEYS_KEPT = 16

V = TypeVar("V")


class SentKeys:
    """The contents' sender: which keys of one kind its peer holds."""

    def __init__(self) -> None:
        self._sent: set[Hashable] = set()
        self.peer_keeps = False
        """The peer said it keeps this kind (``<kind>_keys``): only then may a key go alone."""

    def alone(self, key: Hashable) -> bool:
        """Whether ``key`` may go without its contents; when not, they go with it and count as
        held from now on (counted even before the peer said it keeps them, since it may)."""
        if key in self._sent:
            return self.peer_keeps
        if len(self._sent) >= KEYS_KEPT:
            self._sent.clear()
        self._sent.add(key)
        return False


class KeptByKey(Generic[V]):
    """The keeper: what it made of the contents each key of one kind came with (``field``
    names the key's field in errors)."""

    def __init__(self, field: str) -> None:
        self.field = field
        self._known: dict[Hashable, V] = {}

    def keep(self, key: Hashable, value: V) -> V:
        if key not in self._known and len(self._known) >= KEYS_KEPT:
            self._known.clear()
        self._known[key] = value
        return value

    def get(self, key: Hashable) -> V | None:
        return self._known.get(key)

    def held(self, key: bytes, what: str) -> V:
        """The contents kept under ``key``, which ``what`` (a message) came with alone.

        Raises:
            ProtocolError: this stream holds nothing under ``key``, naming the field and key.
        """
        value = self._known.get(key)
        if value is None:
            raise ProtocolError(unknown_key(what, self.field, key))
        return value


def unknown_key(what: str, field: str, key: bytes) -> str:
    """Why ``what``, sent by ``field`` ``key`` alone, cannot be taken."""
    return (
        f"{what} came by {field} {key.hex()} alone, but this stream holds nothing under that "
        "key (never sent with its contents on this stream, or they were refused); send the "
        "contents with the key"
    )
