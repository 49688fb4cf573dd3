"""A bounded memo: the last few results by key, the least recently used dropped first.

The sender's planning memos (tensor plans, direct reads, slice plans, mapped offers) each keep
the last few layouts a trainer alternates between, a receiver's (``receiver/accepted.py``) the
boxes and write offers of its last manifests. Not locked: every user calls it under its
owner's lock (the coordinator's) or on its one thread (the receiver's).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Memo(Generic[K, V]):
    """The values of the last ``max_entries`` keys used. A hit counts as a use; a miss computes
    the value and keeps it, None included, dropping the least recently used beyond the bound.
    What is dropped is only dereferenced: a value that holds memory (mapped buffers) frees it
    when its last reference goes."""

    def __init__(self, max_entries: int) -> None:
        self._max = max_entries
        self._values: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K, compute: Callable[[], V]) -> V:
        """The value kept for ``key``, else ``compute()`` kept (nothing is kept if it raises)."""
        if key in self._values:
            self._values.move_to_end(key)
            return self._values[key]
        value = self._values[key] = compute()
        while len(self._values) > self._max:
            self._values.popitem(last=False)
        return value

    def clear(self) -> None:
        self._values.clear()


class Same:
    """A key part that matches only these very objects (``is``, not ``==``): for inputs that
    are replaced, never changed in place, when they change (a tensor plan, a receiver's
    declared boxes), and whose equality would cost more than planning again. Kept in a memo's
    key, it keeps them alive, so no other object can take their ids while the entry is kept."""

    __slots__ = ("_hash", "_objects")

    def __init__(self, *objects: object) -> None:
        self._objects = objects
        self._hash = hash(tuple(map(id, objects)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Same)
            and len(other._objects) == len(self._objects)
            and all(a is b for a, b in zip(self._objects, other._objects, strict=True))
        )
