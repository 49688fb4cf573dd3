"""CUDA MPS for a bench run (``weightsync bench --mps``), and whether it is on.

Without MPS a GPU runs the kernels of one process at a time: when two processes issue work on
one GPU during a sync (a sender's NCCL root and an engine's member of another sender's group,
as in the hosts case), the GPU switches between them in time slices, and an NCCL kernel that
spins for its peer while the peer's process is not on its GPU wastes its slice (issue 32: two
senders at once 182 ms without MPS, 57 ms with it, 4 x H200). With ``--mps`` the bench starts
a control daemon of its own (pipe and log directories in a temporary folder, so it neither
joins nor disturbs one already running) before any of its processes touches CUDA, points every
process it starts at it, and asks it to stop at the end. The daemon's ``quit`` waits for its
clients, this process among them until it exits, so a detached shell sends it and removes the
temporary folder once the daemon is gone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from weightsync.errors import ConfigError

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
"""Where clients look for the daemon when ``CUDA_MPS_PIPE_DIRECTORY`` is unset."""
_TIMEOUT_S = 30.0


@dataclass
class PrivateMps:
    """The daemon :func:`private_mps` runs: its pipe directory and, once the block is left, the
    detached process that stops it (it ends when the daemon has)."""

    pipe: Path
    stopper: subprocess.Popen | None = None


def mps_state() -> str:
    """``on (<pipe directory>)`` where a control daemon's socket is where this process's CUDA
    clients would look for it, else ``off``."""
    pipe = os.environ.get(PIPE_ENV) or DEFAULT_PIPE_DIR
    return f"on ({pipe})" if (Path(pipe) / "control").exists() else "off"


@contextmanager
def private_mps() -> Iterator[PrivateMps]:
    """Run a CUDA MPS control daemon of this process's own while the block runs; its pipe
    directory is set in ``os.environ`` for the processes started inside.

    Raises:
        ConfigError: ``nvidia-cuda-mps-control`` is not on ``PATH``, this process already uses
            CUDA (it would stay outside MPS), or the daemon did not start (its log is quoted).
    """
    control = shutil.which(CONTROL)
    if control is None:
        raise ConfigError(f"--mps: {CONTROL} is not on PATH (it ships with the NVIDIA driver)")
    if torch.cuda.is_initialized():
        raise ConfigError("--mps: this process already uses CUDA; start MPS before that")
    root = Path(tempfile.mkdtemp(prefix="ws-mps-"))
    dirs = {PIPE_ENV: root / "pipe", LOG_ENV: root / "log"}
    for d in dirs.values():
        d.mkdir()
    ours = {k: str(v) for k, v in dirs.items()}
    env = {**os.environ, **ours}
    saved = {k: os.environ.get(k) for k in dirs}
    daemon = PrivateMps(dirs[PIPE_ENV])
    try:
        started = subprocess.run(
            [control, "-d"], env=env, capture_output=True, text=True, timeout=_TIMEOUT_S
        )
        if started.returncode != 0 or not _socket_appears(dirs[PIPE_ENV] / "control"):
            raise ConfigError(
                f"--mps: {CONTROL} -d exited {started.returncode} without a control socket in "
                f"{dirs[PIPE_ENV]}: {(started.stderr or started.stdout).strip()}{_log(dirs)}"
            )
    except BaseException:
        # A daemon that forked but made no socket in time must not outlive its folder; with
        # no client yet its quit returns at once.
        _stop(control, env, root).wait(timeout=_TIMEOUT_S)
        shutil.rmtree(root, ignore_errors=True)
        raise
    os.environ.update(ours)
    try:
        yield daemon
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        daemon.stopper = _stop(control, env, root)


def _stop(control: str, env: dict[str, str], root: Path) -> subprocess.Popen:
    """Ask the daemon to quit and remove its folder once it has, detached from this process
    (the daemon's quit waits for its clients, this process among them)."""
    return subprocess.Popen(
        ["sh", "-c", 'echo quit | "$1"; rm -rf "$2"', "stop-mps", control, str(root)],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def _socket_appears(path: Path) -> bool:
    """The daemon forks before it makes its socket."""
    deadline = time.monotonic() + _TIMEOUT_S
    while not path.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _log(dirs: dict[str, Path]) -> str:
    log = dirs[LOG_ENV] / "control.log"
    return f"; {log}: {log.read_text().strip()[-500:]}" if log.exists() else ""
