"""The trace's CPU side: marks written per process, GPU marks of a CPU device skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_SCRIPT = """
import torch
from weightsync import trace
trace.set_role("unit")
trace.mark("before", index=3)
trace.gpu_mark("never", torch.device("cpu"))
trace.flush_gpu()
trace.mark("after")
"""


def _traced(script: str, tmp_path) -> list[dict]:
    """The events ``script`` (role ``unit``) traced, in file order."""
    env = {**os.environ, "WEIGHTSYNC_TRACE_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    (path,) = tmp_path.glob("unit-*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_marks_land_in_order_and_cpu_gpu_marks_are_skipped(tmp_path):
    events = [e for e in _traced(_SCRIPT, tmp_path) if e["event"] != "gc"]  # e.g. at exit
    assert [e["event"] for e in events] == ["before", "after"]
    assert events[0]["index"] == 3
    assert events[0]["t_ns"] <= events[1]["t_ns"]


_GC_SCRIPT = """
import gc
from weightsync import trace
gc.collect()  # before any mark: not written (the role names the file at the first one)
trace.set_role("unit")
trace.mark("before")
gc.collect()
trace.mark("after")
"""


def test_a_full_garbage_collection_is_marked_with_its_length(tmp_path):
    events = _traced(_GC_SCRIPT, tmp_path)
    before, after = (next(e for e in events if e["event"] == n) for n in ("before", "after"))
    full = next(e for e in events if e["event"] == "gc")  # the second gc.collect()
    assert before["t_ns"] <= full["t_ns"] <= after["t_ns"]
    assert full["generation"] == 2 and full["ms"] >= 0 and full["collected"] >= 0
