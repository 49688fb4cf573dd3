"""Opt-in timeline of a sync across processes: set ``WEIGHTSYNC_TRACE_DIR`` to a folder.

Every process (trainer ranks, sender, receivers) then appends named events with
``time.perf_counter_ns()`` (CLOCK_MONOTONIC on Linux: one clock for every process on a host)
to ``<dir>/<role>-<pid>.jsonl``, a line per event as it happens (so a killed process leaves
its trace too). ``weightsync trace DIR`` lines the files up into one timeline, so a slow sync
shows where its time went without a profiler. When the variable is unset, :func:`mark` costs
one attribute check.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

_DIR = os.environ.get("WEIGHTSYNC_TRACE_DIR", "")
enabled = bool(_DIR)
_lock = threading.Lock()
_role = "process"
_file = None


def set_role(role: str) -> None:
    """Name this process in the trace (``sender``, ``receiver``, ``publisher`` ...)."""
    global _role
    _role = role


def mark(event: str, **fields) -> None:
    """Record ``event`` now (no-op unless tracing is on)."""
    if not enabled:
        return
    global _file
    t = time.perf_counter_ns()
    line = json.dumps(
        {"t_ns": t, "thread": threading.current_thread().name, "event": event, **fields}
    )
    with _lock:
        if _file is None:
            Path(_DIR).mkdir(parents=True, exist_ok=True)
            _file = open(Path(_DIR) / f"{_role}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
        _file.write(line + "\n")


def load(directory: str | Path) -> list[dict]:
    """Every event under ``directory``, in time order, each with its ``process`` file stem."""
    events = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                events.append({"process": path.stem, **json.loads(line)})
    return sorted(events, key=lambda e: e["t_ns"])
