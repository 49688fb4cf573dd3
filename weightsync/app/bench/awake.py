"""CPUs kept from halting during a bench run (``weightsync bench --awake-cpus``).

On a virtual machine a CPU with nothing to run halts and the hypervisor takes it away; a
message for a thread that slept there wakes it through the hypervisor, tens to hundreds of
microseconds, and the thread runs slower for a while after. A version crosses five such waits
(the publisher's begin, the receiver's batch and hand-over, ``applied``, ``done``). On two KVM
guests with one H200 (2026-11-29) a direct 7B version took 9.3-9.6 ms, 8.8-9.0 ms with every
CPU kept busy; on a third the same either way (docs/benchmarks.md). Kernels do the same
without spending user time: the guest's ``cpuidle_haltpoll`` driver (boot parameter
``cpuidle_haltpoll.force=1``) or ``idle=poll``.

Here one spinning process per CPU at ``SCHED_IDLE``, the lowest priority: it runs only where
nothing else wants the CPU, so it takes no time from the bench's processes, but no CPU halts.
It shows what a host tuned that way would measure; it is no setting for production (every CPU
stays at 100 %).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from weightsync.errors import ConfigError

_SPIN = """
import os, sys
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
print("spinning", flush=True)
parent = int(sys.argv[1])
while os.getppid() == parent:  # ends with the bench, even a killed one
    for _ in range(1_000_000):  # no system call in the loop: on some guests each one exits
        pass
"""

_START_S = 30.0
"""How long the spinners may take to start, all together (an interpreter each)."""

_spinners = 0


def awake_state() -> int:
    """How many CPUs :func:`awake_cpus` keeps busy now (0: none)."""
    return _spinners


@contextmanager
def awake_cpus() -> Iterator[list[subprocess.Popen]]:
    """A ``SCHED_IDLE`` spinner per CPU this process may run on while the block runs (each
    has set its priority before the block starts); they are killed when it ends.

    Raises:
        ConfigError: this platform has no ``SCHED_IDLE``, or a spinner did not start (within
            :data:`_START_S`).
    """
    global _spinners
    if not hasattr(os, "SCHED_IDLE"):
        raise ConfigError("--awake-cpus needs Linux's SCHED_IDLE scheduling class")
    spinners: list[subprocess.Popen] = []
    try:
        for _ in os.sched_getaffinity(0):  # the CPUs this process (and the bench's) may use
            spinners.append(
                subprocess.Popen(
                    [sys.executable, "-c", _SPIN, str(os.getpid())],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        deadline = time.monotonic() + _START_S
        for spinner in spinners:
            left = max(0.0, deadline - time.monotonic())
            if not select.select([spinner.stdout], [], [], left)[0]:
                raise ConfigError(
                    f"--awake-cpus: a spinner (pid {spinner.pid}) did not start within "
                    f"{_START_S:g} s; run without --awake-cpus"
                )
            if spinner.stdout.readline().strip() != "spinning":
                raise ConfigError(
                    f"--awake-cpus: a spinner did not start: {spinner.stderr.read().strip()}"
                )
        _spinners = len(spinners)
        yield spinners
    finally:
        _spinners = 0
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()
            spinner.stdout.close()
            spinner.stderr.close()
