"""Waiting on a condition instead of sleeping, with a message when it never comes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], timeout: float, message: str, interval: float = 0.01
) -> T:
    """Call ``condition`` until it returns something truthy, and return that.

    Raises:
        AssertionError: ``message``, the timeout and ``condition``'s last value, when nothing
            truthy came within ``timeout`` seconds. Exceptions from ``condition`` propagate.
    """
    deadline = time.monotonic() + timeout
    while True:
        last = condition()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message} (not within {timeout:g} s; last value: {last!r})")
        time.sleep(interval)
