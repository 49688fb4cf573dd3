"""Opt-in timeline of a sync across processes: set ``WEIGHTSYNC_TRACE_DIR`` to a folder.

Every process (trainer ranks, sender, receivers) then records named events with
``time.perf_counter_ns()`` (CLOCK_MONOTONIC on Linux: one clock for every process on a host)
and writes them at exit to ``<dir>/<role>-<pid>.jsonl``. ``weightsync trace DIR`` lines the
files up into one timeline, so a slow sync shows where its time went without a profiler.
When the variable is unset, :func:`mark` costs one attribute check.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path

_DIR = os.environ.get("WEIGHTSYNC_TRACE_DIR", "")
enabled = bool(_DIR)
_events: list[tuple[int, str, str, dict]] = []
_lock = threading.Lock()
_role = "process"


def set_role(role: str) -> None:
    """Name this process in the trace (``sender``, ``receiver``, ``publisher`` ...)."""
    global _role
    _role = role


def mark(event: str, **fields) -> None:
    """Record ``event`` now (no-op unless tracing is on)."""
    if enabled:
        _events.append((time.perf_counter_ns(), threading.current_thread().name, event, fields))


def flush() -> Path | None:
    """Write this process's events (also runs at exit); returns the file written."""
    if not enabled or not _events:
        return None
    with _lock:
        events, _events[:] = list(_events), []
    path = Path(_DIR) / f"{_role}-{os.getpid()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for t, thread, event, fields in events:
            f.write(json.dumps({"t_ns": t, "thread": thread, "event": event, **fields}) + "\n")
    return path


def load(directory: str | Path) -> list[dict]:
    """Every event under ``directory``, in time order, each with its ``process`` file stem."""
    events = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            events.append({"process": path.stem, **json.loads(line)})
    return sorted(events, key=lambda e: e["t_ns"])


if enabled:
    atexit.register(flush)
