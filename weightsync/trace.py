"""Opt-in timeline of a sync across processes: set ``WEIGHTSYNC_TRACE_DIR`` to a folder.

Every process (trainer ranks, sender, receivers) then appends named events with
``time.perf_counter_ns()`` (CLOCK_MONOTONIC on Linux: one clock for every process on a host)
to ``<dir>/<role>-<pid>.jsonl``, a line per event as it happens (so a killed process leaves
its trace too). ``weightsync trace DIR`` lines the files up into one timeline, so a slow sync
shows where its time went without a profiler. When the variable is unset, :func:`mark` and
:func:`gpu_mark` cost one attribute check.

A CPU mark says when work was queued; on CUDA the work itself runs later. :func:`gpu_mark`
records when the device reached a point (a CUDA event on a trace stream of its own, ordered after
the current stream and, optionally, a collective), converted to the same clock through one
anchor event per device; it is written once the device got there.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_DIR = os.environ.get("WEIGHTSYNC_TRACE_DIR", "")
enabled = bool(_DIR)
_lock = threading.Lock()
_role = "process"
_file = None
_gpu_pending: list[tuple[Any, str, dict, tuple[Any, int]]] = []
"""(event, name, fields, its device's anchor) recorded and not yet written."""
_gpu_clocks: dict[Any, tuple[Any, tuple[Any, int]]] = {}
"""Per device: the trace stream, and the anchor (an event and its perf_counter_ns)."""


def set_role(role: str) -> None:
    """Name this process in the trace (``sender``, ``receiver``, ``publisher`` ...)."""
    global _role
    _role = role


def mark(event: str, **fields) -> None:
    """Record ``event`` now (no-op unless tracing is on)."""
    if not enabled:
        return
    _write(time.perf_counter_ns(), event, fields)
    if _gpu_pending:
        flush_gpu(block=False)


def gpu_mark(event: str, device, after: Callable[[], None] | None = None, **fields) -> None:
    """Record ``event`` when CUDA ``device`` gets past the work queued so far on its current
    stream and, if given, the work ``after()`` orders the current stream behind (a
    collective's ``wait``); no-op unless tracing is on or for a CPU device."""
    if not enabled or getattr(device, "type", "cpu") != "cuda":
        return
    import torch

    with _lock:
        if device not in _gpu_clocks:
            stream = torch.cuda.Stream(device)
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record(stream)
            anchor.synchronize()
            _gpu_clocks[device] = (stream, (anchor, time.perf_counter_ns()))
        stream, anchor_at = _gpu_clocks[device]
    stream.wait_stream(torch.cuda.current_stream(device))
    if after is not None:
        with torch.cuda.stream(stream):
            after()
    done = torch.cuda.Event(enable_timing=True)
    done.record(stream)
    with _lock:
        _gpu_pending.append((done, event, {**fields, "gpu": str(device)}, anchor_at))


def flush_gpu(block: bool = True) -> None:
    """Write the GPU marks the devices have reached (``block``: wait for all of them)."""
    if not enabled:
        return
    # Taken off the list under the lock: marks are flushed from any thread, and each must be
    # written once.
    with _lock:
        reached = [p for p in _gpu_pending if block or p[0].query()]
        for item in reached:
            _gpu_pending.remove(item)
    for done, event, fields, (anchor, anchor_ns) in reached:
        done.synchronize()
        _write(anchor_ns + int(anchor.elapsed_time(done) * 1e6), event, fields)


def _write(t_ns: int, event: str, fields: dict) -> None:
    global _file
    line = json.dumps(
        {"t_ns": t_ns, "thread": threading.current_thread().name, "event": event, **fields}
    )
    with _lock:
        if _file is None:
            Path(_DIR).mkdir(parents=True, exist_ok=True)
            _file = open(Path(_DIR) / f"{_role}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
        _file.write(line + "\n")


_GC_MARK_NS = 200_000
"""Collections at least this long (or of the oldest generation) are marked: a full collection
walks every object the process holds, which in a process holding a large model's plans takes
milliseconds, in the middle of whatever thread allocated."""
_gc_started = [0]


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter_ns()
        return
    took = time.perf_counter_ns() - _gc_started[0]
    # Not before the process's first mark: its file is named by the role set before that.
    if _file is not None and (info["generation"] == 2 or took >= _GC_MARK_NS):
        fields = {"generation": info["generation"], "ms": round(took / 1e6, 3)}
        _write(_gc_started[0], "gc", {**fields, "collected": info["collected"]})


if enabled:
    gc.callbacks.append(_on_gc)


def load(directory: str | Path) -> list[dict]:
    """Every event under ``directory``, in time order, each with its ``process`` file stem."""
    events = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                events.append({"process": path.stem, **json.loads(line)})
    return sorted(events, key=lambda e: e["t_ns"])
