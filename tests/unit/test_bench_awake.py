"""``weightsync bench --awake-cpus`` (weightsync/app/bench/awake.py): a spinner per CPU at
SCHED_IDLE while the block runs, none after, even when the block raises, and the report's
title says so. Real processes; what the spinners do to a sync's time is a GPU benchmark
(docs/benchmarks.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.support.processes import parent_of
from tests.support.waiting import wait_until
from weightsync.app.bench import awake
from weightsync.app.bench.report import Report
from weightsync.errors import ConfigError


def _gone(pid: int) -> bool:
    return parent_of(pid) is None


def test_a_spinner_per_cpu_at_the_lowest_priority_while_the_block_runs():
    assert awake.awake_state() == 0
    with awake.awake_cpus() as spinners:
        assert len(spinners) == len(os.sched_getaffinity(0)) == awake.awake_state()
        for spinner in spinners:
            assert spinner.poll() is None
            assert os.sched_getscheduler(spinner.pid) == os.SCHED_IDLE
    assert awake.awake_state() == 0
    assert all(spinner.poll() is not None for spinner in spinners)
    assert all(_gone(spinner.pid) for spinner in spinners)


def test_the_spinners_end_when_the_block_raises():
    with pytest.raises(RuntimeError, match="boom"), awake.awake_cpus() as spinners:
        raise RuntimeError("boom")
    assert all(spinner.poll() is not None for spinner in spinners)
    assert awake.awake_state() == 0


def test_a_spinner_that_never_starts_fails_the_block_at_the_start_up_bound(monkeypatch):
    """A spinner stuck before it could start fails at the start-up bound, not never."""
    monkeypatch.setattr(awake, "_SPIN", "import time; time.sleep(3600)")
    monkeypatch.setattr(awake, "_START_S", 0.5)
    with pytest.raises(ConfigError, match=r"did not start within 0.5 s"):
        with awake.awake_cpus():
            pass
    assert awake.awake_state() == 0


def test_without_sched_idle_the_error_says_what_is_missing(monkeypatch):
    monkeypatch.delattr(os, "SCHED_IDLE")
    with pytest.raises(ConfigError, match="SCHED_IDLE"), awake.awake_cpus():
        pass


@pytest.mark.parametrize(("awake_cpus", "shown"), [(0, False), (16, True)])
def test_the_table_title_says_when_cpus_were_kept_awake(awake_cpus, shown):
    meta = {
        "model": "tiny", "model_note": "all layers", "tensors": 1, "gb": 0.0, "versions": 1,
        "warmup": 0, "mps": "off", "awake_cpus": awake_cpus, "notes": [],
    }  # fmt: skip
    title = Report(meta).table().title
    assert ("16 CPUs kept awake" in title) is shown


BENCH = textwrap.dedent(
    """
    import time
    from weightsync.app.bench.awake import awake_cpus
    with awake_cpus() as spinners:
        print(" ".join(str(s.pid) for s in spinners), flush=True)
        time.sleep(600)
    """
)


def test_the_spinners_end_with_a_killed_bench():
    """Killed, the bench runs no ``finally``: each spinner sees its parent gone and ends."""
    bench = subprocess.Popen([sys.executable, "-c", BENCH], stdout=subprocess.PIPE, text=True)
    pids = [int(pid) for pid in bench.stdout.readline().split()]
    assert len(pids) == len(os.sched_getaffinity(0))
    bench.send_signal(signal.SIGKILL)
    bench.wait()
    bench.stdout.close()
    wait_until(lambda: all(_gone(pid) for pid in pids), 30, "spinners outlived their bench")
