"""The node bench's process reports (the GPU run itself is in tests/gpu/test_node_sources.py)."""

from __future__ import annotations

import queue
import time

import pytest

from weightsync.app.bench import node
from weightsync.errors import SyncTimeoutError, WeightSyncError


def _fails(value: int, out) -> None:
    raise ValueError(f"bad {value}")


def test_a_failed_process_stops_the_bench_at_once_naming_it():
    out: queue.Queue = queue.Queue()
    out.put(("ready", 0))
    with pytest.raises(ValueError, match="bad 3"):
        node._child("receiver on GPU 1", _fails, 3, out)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="the receiver on GPU 1 failed: ValueError: bad 3"):
        node._collect(out, {"ready": 2}, timeout_s=60)
    assert time.monotonic() - start < 5


def test_reports_are_collected_in_any_order_and_extra_ones_refused():
    out: queue.Queue = queue.Queue()
    for item in [("applied", 1, ""), ("published", 0, b""), ("applied", 0, "")]:
        out.put(item)
    got = node._collect(out, {"published": 1, "applied": 2}, timeout_s=5)
    assert [r for _, r, _ in got["applied"]] == [1, 0] and len(got["published"]) == 1
    out.put(("applied", 2, ""))
    with pytest.raises(RuntimeError, match="unexpected report"):
        node._collect(out, {"published": 1}, timeout_s=5)


def test_reports_that_never_come_time_out_naming_what_is_missing():
    out: queue.Queue = queue.Queue()
    out.put(("applied", 1, ""))
    with pytest.raises(SyncTimeoutError, match=r"no report for 0.2 s.*'applied': \[1\]"):
        node._collect(out, {"applied": 2}, timeout_s=0.2)
