"""The bench's process reports (``weightsync/app/bench/children.py``, the node bench's
``_collect``); the GPU runs themselves are in tests/gpu/test_node_sources.py."""

from __future__ import annotations

import os
import queue

import pytest

from tests.support import children as test_children
from weightsync.app.bench import children, node
from weightsync.errors import SyncTimeoutError, WeightSyncError


def _fails(value: int, out) -> None:
    raise ValueError(f"bad {value}")


def _dies_before_reporting(code: int) -> None:
    os._exit(code)


def test_a_failed_process_stops_the_bench_at_once_naming_it():
    out: queue.Queue = queue.Queue()
    out.put(("ready", 0))
    with pytest.raises(ValueError, match="bad 3"):
        children.reporting("receiver on GPU 1", _fails, 3, out)
    with pytest.raises(WeightSyncError, match="the receiver on GPU 1 failed: ValueError: bad 3"):
        node._collect(out, [], {"ready": 2}, timeout_s=600)


def test_a_process_that_dies_without_a_word_fails_the_wait_naming_its_exit_code():
    # A child that dies before it can report (a crash at start-up, the OOM killer) sends
    # nothing: the wait must fail on its exit code, not wait out the timeout (600 s here, which
    # would raise SyncTimeoutError instead).
    out = test_children.queue()
    proc = test_children.process(_dies_before_reporting, (7,))
    proc.start()
    with pytest.raises(
        WeightSyncError, match=r"fp8 bench \(0 of 1 'ready' reports\): .*exit code 7"
    ):
        children.expect(out, [proc], "ready", 1, 600, "fp8 bench")
    proc.join(30)


def test_reports_are_collected_in_any_order_and_extra_ones_refused():
    out: queue.Queue = queue.Queue()
    for item in [("applied", 1, ""), ("published", 0, b""), ("applied", 0, "")]:
        out.put(item)
    got = node._collect(out, [], {"published": 1, "applied": 2}, timeout_s=5)
    assert [r for _, r, _ in got["applied"]] == [1, 0] and len(got["published"]) == 1
    out.put(("applied", 2, ""))
    with pytest.raises(RuntimeError, match="unexpected report"):
        node._collect(out, [], {"published": 1}, timeout_s=5)
    out.put(("paths", 0, {}))
    with pytest.raises(RuntimeError, match=r"hosts bench: unexpected report \('paths', 0\)"):
        children.expect(out, [], "applied", 1, 5, "hosts bench")


def test_reports_that_never_come_time_out_naming_what_is_missing():
    out: queue.Queue = queue.Queue()
    out.put(("applied", 1, ""))
    with pytest.raises(SyncTimeoutError, match=r"'applied': \[1\]\}: no report for 0.2 s"):
        node._collect(out, [], {"applied": 2}, timeout_s=0.2)
