"""The bench's spawned processes and scratch directories, cleaned up however a measurement
ends: on an error (a receiver that never reports, a wrong byte) nothing is left running or on
disk."""

from __future__ import annotations

import queue
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.process import BaseProcess

from weightsync.errors import SyncTimeoutError, WeightSyncError

JOIN_S = 60
"""How long a child may take to exit once the block ends without an error."""
POLL_S = 1.0
"""How often a wait for a report looks whether a child died."""


@contextmanager
def children() -> Iterator[list[BaseProcess]]:
    """A list to add started processes to. When the block ends they are joined; any still alive
    then, or when the block raised, is terminated."""
    procs: list[BaseProcess] = []
    try:
        yield procs
        for p in procs:
            p.join(JOIN_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()


@contextmanager
def scratch_dir(prefix: str) -> Iterator[str]:
    """A new directory under /tmp (short enough for Unix sockets), removed with what it holds."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def reporting(what: str, body, *args) -> None:
    """A child process running ``body(*args)`` (the report queue last): its failure is reported
    as ``("failed", what, why)`` at once, then raised."""
    try:
        body(*args)
    except BaseException as e:
        args[-1].put(("failed", what, f"{type(e).__name__}: {e}"))
        raise


def report(out, procs: Sequence[BaseProcess], timeout_s: float, what: str) -> tuple:
    """The next report on the queue ``out``. A child of ``procs`` that died (a crash at start-up,
    a signal, the OOM killer) reports nothing: it fails the wait at once, not ``timeout_s`` later.

    Raises:
        WeightSyncError: a child exited with a non-zero code (naming it and the code), or
            reported ``("failed", who, why)``.
        SyncTimeoutError: nothing came for ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            item = out.get(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
        except queue.Empty:
            dead = [f"{p.name} (exit code {p.exitcode})" for p in procs if p.exitcode]
            if dead:
                raise WeightSyncError(
                    f"{what}: {', '.join(dead)} ended without reporting; its output above says why"
                ) from None
            if time.monotonic() < deadline:
                continue
            raise SyncTimeoutError(f"{what}: no report for {timeout_s:g} s (--timeout-s)") from None
        if item[0] == "failed":
            raise WeightSyncError(f"{what}: the {item[1]} failed: {item[2]}")
        return item


def expect(out, procs: Sequence[BaseProcess], kind: str, n: int, timeout_s: float, what: str):
    """The next ``n`` reports, each ``(kind, ...)``, as :func:`report` gets them.

    Raises:
        RuntimeError: a report of another kind came.
    """
    got = []
    while len(got) < n:
        item = report(out, procs, timeout_s, f"{what} ({len(got)} of {n} {kind!r} reports)")
        if item[0] != kind:
            raise RuntimeError(f"{what}: unexpected report {item[:2]!r}")
        got.append(item)
    return got
