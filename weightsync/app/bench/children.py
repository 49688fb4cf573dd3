"""The bench's spawned processes and scratch directories, cleaned up however a measurement
ends: on an error (a receiver that never reports, a wrong byte) nothing is left running or on
disk."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess

JOIN_S = 60
"""How long a child may take to exit once the block ends without an error."""


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
