"""One generic registry with lazy ``module:attr`` entries (transports, engine targets)."""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

from weightsync.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> class, imported on first use so optional dependencies stay optional."""

    def __init__(self, kind: str, entries: dict[str, str]) -> None:
        self._kind = kind
        self._entries = dict(entries)
        self._loaded: dict[str, T] = {}

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> T:
        if name in self._loaded:
            return self._loaded[name]
        try:
            target = self._entries[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self._kind} {name!r}; known: {', '.join(self.names())}"
            ) from None
        module_name, _, attr = target.partition(":")
        value = getattr(importlib.import_module(module_name), attr)
        self._loaded[name] = value
        return value
