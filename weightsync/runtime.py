"""Interpreter settings for the processes weightsync owns (the sender daemon, the bench)."""

from __future__ import annotations

import sys

SWITCH_INTERVAL_S = 0.0005


def prefer_latency() -> None:
    """Hand the GIL over more often than Python's default 5 ms.

    A version is a relay of messages between gRPC, driver and pump threads; a thread woken by
    a message otherwise waits up to the switch interval behind any busy thread (traces showed
    a finished version's reply waiting 2.5 ms behind a log line being rendered).
    """
    sys.setswitchinterval(SWITCH_INTERVAL_S)
