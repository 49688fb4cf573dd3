"""``weightsync bench --mps``: the private MPS daemon's lifetime and the environment it leaves.

The real ``nvidia-cuda-mps-control`` needs an NVIDIA driver, which CI's machine has not; here a
shell script of that name stands in for it (it makes and removes the control socket's file the
way the daemon does). The real daemon ran under ``weightsync bench --mps`` on 4 x H200
(docs/benchmarks.md).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch

from weightsync.app.bench import mps
from weightsync.errors import ConfigError

_STUB = """#!/bin/sh
if [ "$1" = "-d" ]; then
  echo "daemon $CUDA_MPS_PIPE_DIRECTORY" >> "{calls}"
  [ -n "$STUB_FAIL" ] && {{ echo "cannot start: $STUB_FAIL" >&2; exit 1; }}
  : > "$CUDA_MPS_PIPE_DIRECTORY/control"
  exit 0
fi
read cmd
echo "$cmd $CUDA_MPS_PIPE_DIRECTORY" >> "{calls}"
[ "$cmd" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
"""


@pytest.fixture
def control(tmp_path, monkeypatch) -> Path:
    """A stand-in ``nvidia-cuda-mps-control`` first on PATH; returns the file of its calls."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    stub = bin_dir / mps.CONTROL
    stub.write_text(_STUB.format(calls=calls))
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(mps.PIPE_ENV, str(tmp_path / "someone-elses-pipe"))
    monkeypatch.delenv(mps.LOG_ENV, raising=False)
    return calls


def test_the_daemon_runs_while_the_block_does_and_the_environment_comes_back(control):
    before = os.environ[mps.PIPE_ENV]
    assert mps.mps_state() == "off"
    with mps.private_mps() as daemon:
        pipe = daemon.pipe
        assert os.environ[mps.PIPE_ENV] == str(pipe) != before
        assert Path(os.environ[mps.LOG_ENV]).is_dir()
        assert mps.mps_state() == f"on ({pipe})"
        assert control.read_text().splitlines() == [f"daemon {pipe}"]
    # The stop is detached (the real daemon's quit waits for this process to exit).
    assert daemon.stopper.wait(timeout=60) == 0
    assert control.read_text().splitlines() == [f"daemon {pipe}", f"quit {pipe}"]
    assert os.environ[mps.PIPE_ENV] == before
    assert mps.LOG_ENV not in os.environ
    assert not pipe.parent.exists()
    assert mps.mps_state() == "off"


def test_the_daemon_stops_when_the_block_raises(control):
    with pytest.raises(RuntimeError, match="the bench failed"), mps.private_mps() as daemon:
        raise RuntimeError("the bench failed")
    assert daemon.stopper.wait(timeout=60) == 0
    assert control.read_text().splitlines()[-1] == f"quit {daemon.pipe}"
    assert not daemon.pipe.parent.exists()


def test_a_daemon_that_does_not_start_is_an_error_quoting_it(control, monkeypatch):
    before = dict(os.environ)
    monkeypatch.setenv("STUB_FAIL", "no GPU")
    made = set(Path(tempfile.gettempdir()).glob("ws-mps-*"))
    with pytest.raises(ConfigError, match=r"exited 1 without a control socket.*no GPU"):
        with mps.private_mps():
            pytest.fail("the block must not run")
    assert os.environ == {**before, "STUB_FAIL": "no GPU"}
    assert set(Path(tempfile.gettempdir()).glob("ws-mps-*")) == made
    # Asked to quit all the same: a daemon that forked but made no socket is not left behind.
    assert control.read_text().splitlines()[-1].startswith("quit ")


def test_without_the_binary_the_error_names_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="nvidia-cuda-mps-control is not on PATH"):
        with mps.private_mps():
            pytest.fail("the block must not run")


def test_a_process_already_using_cuda_is_refused(control, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ConfigError, match="already uses CUDA"):
        with mps.private_mps():
            pytest.fail("the block must not run")
    assert not control.exists()


def test_the_default_pipe_directory_counts_when_none_is_set(monkeypatch, tmp_path):
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", str(tmp_path))
    assert mps.mps_state() == "off"
    (tmp_path / "control").touch()
    assert mps.mps_state() == f"on ({tmp_path})"
