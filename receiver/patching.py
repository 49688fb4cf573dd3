"""Patching an engine's classes where it has no hook, each target checked first, so an engine
whose layout moved fails with a :class:`ConfigError` naming what moved, never silently."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from weightsync.errors import ConfigError

PATCHED = "__weightsync_patched__"
"""Set on a replacement, so patching twice (engines load plugins more than once) is a no-op."""

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]
"""Makes the replacement of an engine function from the original."""


def target(
    owner: Any, name: str, params: tuple[str, ...], layout_error: Callable[[str], ConfigError]
) -> Callable[..., Any]:
    """``owner.name``, checked to exist and to take ``params``.

    Raises:
        ConfigError: from ``layout_error``, naming what is missing.
    """
    function = getattr(owner, name, None)
    if not callable(function):
        raise layout_error(f"{owner.__qualname__}.{name} is missing")
    missing = [p for p in params if p not in inspect.signature(function).parameters]
    if missing:
        raise layout_error(f"{owner.__qualname__}.{name} lacks parameter(s) {missing}")
    return function


def patch(
    owner: Any,
    name: str,
    make: Wrap,
    params: tuple[str, ...],
    layout_error: Callable[[str], ConfigError],
) -> None:
    """Replace ``owner.name`` with ``make(original)`` (checked as :func:`target` does)."""
    original = target(owner, name, params, layout_error)
    if getattr(original, PATCHED, False):
        return
    patched = functools.wraps(original)(make(original))
    setattr(patched, PATCHED, True)
    setattr(owner, name, patched)
