"""Senders and receivers for integration tests: a sender on a short unix socket path, receivers
in their own processes (reporting ``Outcome``s on a queue) or in a thread of the test."""

from __future__ import annotations

import glob
import os
import pickle
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

from tests.support import children
from tests.support.models import TinyNet, digests, step
from weightsync.control.client import connect


@contextmanager
def socket_dir() -> Iterator[str]:
    """A fresh directory under /tmp for unix sockets: their paths are limited to ~107 bytes,
    and pytest's ``tmp_path`` can be longer."""
    d = tempfile.mkdtemp(prefix="ws-", dir="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextmanager
def unix_sender(**settings):
    """A ``Sender`` with ``settings``, listening on a unix socket in a fresh ``socket_dir``."""
    from weightsync.sender.daemon import Sender

    with socket_dir() as d, Sender(f"unix:{d}/s.sock", **settings) as sender:
        yield sender


# --- receivers in their own processes --------------------------------------------------------


class Outcome(NamedTuple):
    """What a receiver process reports after each sync."""

    receiver_id: str
    state: str
    """"applied", or the name of the error's type."""
    version: int
    """The version applied (after an error: the receiver's applied version)."""
    digests: dict[str, str]
    """``digests`` of the receiver's model after the sync."""
    error: str


def sender_process(
    address: str, env: dict[str, str] | None = None, preexec_fn=None
) -> subprocess.Popen:
    """A real `weightsync-sender` daemon, ready once its health check answers; ``env`` is
    set in its environment (e.g. ``WEIGHTSYNC_HOST_ID``), ``preexec_fn`` runs in the child
    before it starts (e.g. to lower a resource limit)."""
    proc = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "weightsync-sender"),
            "--listen",
            address,
            "--bucket-size-mb",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        preexec_fn=preexec_fn,
    )
    try:
        channel, _ = connect(address, timeout_s=30)
    except BaseException:
        proc.kill()  # not left serving after its test gave up on it
        proc.wait()
        raise
    channel.close()
    return proc


def _receiver_main(address, rid, seed, syncs, die_on_version, ready, out, env, model_of):
    import os

    os.environ.update(env)
    from weightsync.errors import WeightSyncError
    from weightsync.receiver import TorchReceiver

    model = model_of(seed)
    receiver = TorchReceiver(model, address, receiver_id=rid)
    if die_on_version:
        load = receiver.target.load

        def load_then_die(tensors):
            if receiver_version[0] == die_on_version:
                # Flush what this process reported first: dying while its queue's feeder
                # thread holds the queue's lock would block every other receiver's reports.
                out.close()
                out.join_thread()
                os._exit(3)  # a crash mid-version, after the first bucket arrived
            load(tensors)

        receiver_version = [0]
        begin = receiver.target.begin
        receiver.target.begin = lambda m: (receiver_version.__setitem__(0, m.version), begin(m))
        receiver.target.load = load_then_die
    ready.put(rid)
    for _ in range(syncs):
        try:
            v = receiver.sync(timeout=60)
            out.put(Outcome(rid, "applied", v, digests(model), ""))
        except WeightSyncError as e:
            out.put(
                Outcome(rid, type(e).__name__, receiver.applied_version, digests(model), str(e))
            )


def start_receivers(
    address: str,
    ids: list[str],
    syncs: int,
    die_on_version: dict | None = None,
    env: dict | None = None,
    model_of=TinyNet,
    out=None,
):
    """Start one process per id, each holding a ``model_of(seed)`` (a ``TinyNet``) and syncing
    ``syncs`` times; returns (processes, out queue of ``Outcome``) once all registered
    (``out``: an earlier call's queue, shared).

    ``die_on_version`` maps a receiver id to a version its process exits (code 3) in, after
    that version's first bucket arrived. ``env`` maps a receiver id to environment variables
    set in its process.
    """
    ready, out = children.queue(), out or children.queue()
    procs = []
    for i, rid in enumerate(ids):
        p = children.process(
            _receiver_main,
            daemon=True,
            args=(
                address,
                rid,
                100 + i,
                syncs,
                (die_on_version or {}).get(rid, 0),
                ready,
                out,
                (env or {}).get(rid, {}),
                model_of,
            ),
        )
        p.start()
        procs.append(p)
    for _ in ids:
        ready.get(timeout=60)
    return procs, out


def kill_receiver(proc, out) -> None:
    """Crash ``proc``, a process of :func:`start_receivers` reporting to ``out``, with SIGKILL,
    holding ``out``'s write lock meanwhile: killed just after a report, while its queue's
    feeder thread still held that lock, it would block every other receiver's reports for
    good (a CI run waited 120 s for one that had applied its version)."""
    with out._wlock:
        proc.kill()
        proc.join(30)


def next_outcomes(out, count: int, timeout: float = 60) -> list[Outcome]:
    """The next ``count`` outcomes from ``start_receivers``' queue, each awaited up to
    ``timeout`` seconds.

    Raises:
        AssertionError: fewer came (a receiver process died or hangs), saying which did.
    """
    got: list[Outcome] = []
    for _ in range(count):
        try:
            got.append(out.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(
                f"{len(got)} of {count} receiver outcomes came; none more within {timeout:g} s: "
                f"{[(o.receiver_id, o.state, o.version) for o in got]}"
            ) from None
    return got


def publish_versions(publisher, trainer, versions, timeout_s: float = 60):
    """Step ``trainer`` (``step(trainer, version)``) and publish it as each of ``versions``,
    waiting until applied; returns ({version: the trainer's digests}, [publish results])."""
    expected, results = {}, []
    for version in versions:
        step(trainer, version)
        results.append(
            publisher.publish(trainer.state_dict(), version, wait=True, timeout_s=timeout_s)
        )
        expected[version] = digests(trainer)
    return expected, results


def assert_applied(got: list[Outcome], expected: dict[int, dict[str, str]]) -> None:
    """Every outcome applied its version, bit-exact: ``expected`` maps version -> digests."""
    for o in got:
        assert o.state == "applied", o.error
        assert o.digests == expected[o.version], f"{o.receiver_id} differs at version {o.version}"


# --- receivers in a thread -------------------------------------------------------------------


class SyncThread(threading.Thread):
    """``receiver.sync()`` ``n`` times in a daemon thread; ``results`` collects each applied
    version or the exception a sync raised."""

    def __init__(self, receiver, n: int = 1, timeout: float = 30) -> None:
        super().__init__(daemon=True)
        self.receiver, self.n, self.timeout = receiver, n, timeout
        self.results: list = []

    def run(self) -> None:
        for _ in range(self.n):
            try:
                self.results.append(self.receiver.sync(timeout=self.timeout))
            except Exception as e:  # collected for the test's assertions
                self.results.append(e)

    def finish(self, timeout: float = 30) -> list:
        """Join; returns ``results``.

        Raises:
            AssertionError: the syncs did not all return within ``timeout`` seconds.
        """
        self.join(timeout)
        assert not self.is_alive(), (
            f"receiver {getattr(self.receiver, 'receiver_id', '?')}: {self.n} sync(s) did not "
            f"return within {timeout:g} s; results so far: {self.results!r}"
        )
        return self.results


def sync_in_thread(receiver, n: int = 1) -> tuple[SyncThread, list]:
    """Start a ``SyncThread``; returns it and its ``results`` list."""
    thread = SyncThread(receiver, n)
    thread.start()
    return thread, thread.results


# --- the fault suite: processes to kill and stop -----------------------------------------------

FAULT_EMBED_ROWS = 60000
"""``fault_model``'s embedding rows: 3.84 MB of fp32, four buckets at the CLI's 1 MiB cap, so
a version lasts as long as four of a slow receiver's loads."""
PUBLISHED_SEED = 1000
"""Version ``v``'s weights are ``fault_model(PUBLISHED_SEED + v)``."""


def fault_model(seed: int) -> TinyNet:
    """A ``TinyNet`` with a ``FAULT_EMBED_ROWS``-row embedding (several buckets a version)."""
    import torch

    model = TinyNet(seed)
    g = torch.Generator().manual_seed(seed)
    model.embed = torch.nn.Parameter(torch.randn(FAULT_EMBED_ROWS, 16, generator=g))
    return model


class Reports:
    """Where the fault suite's processes report ``Outcome``s: a unix datagram socket at
    ``path``, drained into a queue by a thread of the test (``get`` as a queue's).

    Not a shared ``multiprocessing`` queue: its writers share one lock, which each one's feeder
    thread holds while it writes, so a process stopped or killed right after a report (the
    moment the suite strikes) could hold it forever and no other process's report would ever
    come. A datagram is sent whole or not at all and its writers share nothing."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        self._got: queue.Queue = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        # Read at once: the kernel queues only a few datagrams before writers block.
        while True:
            data = self._sock.recv(_MAX_REPORT_BYTES)
            if not data:
                return  # shut down by close (no report is empty)
            self._got.put(pickle.loads(data))

    def get(self, timeout: float) -> Outcome:
        """The next report. Raises queue.Empty when none came within ``timeout`` seconds."""
        return self._got.get(timeout=timeout)

    def close(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


_MAX_REPORT_BYTES = 1 << 17
"""A report is one datagram, at most this big (well under the socket's send buffer)."""


class Reporter:
    """A process's side of ``Reports``: ``put`` sends one ``Outcome`` (or any picklable)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def put(self, report) -> None:
        self._sock.sendto(pickle.dumps(report), self.path)


def fault_reports(path: str) -> Reports:
    """The ``Reports`` (a socket at ``path``, in a ``socket_dir``) that ``start_slow_receiver``
    and ``start_publisher_process`` report to."""
    return Reports(path)


class Inbox:
    """Everything a ``Reports`` brought, with when it came (``time.monotonic()``)."""

    def __init__(self, out) -> None:
        self.out = out
        self.seen: list[tuple[float, Outcome]] = []

    def wait(self, condition, timeout: float, message: str):
        """Read the queue until ``condition(self.seen)`` is truthy; returns it.

        Raises:
            AssertionError: ``message`` and the last reports, when it was not within
                ``timeout`` seconds.
        """
        import time

        deadline = time.monotonic() + timeout
        while not (hit := condition(self.seen)):
            if time.monotonic() > deadline:
                last = [(o.receiver_id, o.state, o.version) for _, o in self.seen[-12:]]
                raise AssertionError(f"{message} (not within {timeout:g} s; last: {last})")
            try:
                self.seen.append((time.monotonic(), self.out.get(timeout=0.2)))
            except queue.Empty:
                pass
        return hit

    def find(self, rid: str, state: str, version: int) -> list[tuple[float, Outcome]]:
        return [
            (t, o)
            for t, o in self.seen
            if (o.receiver_id, o.state, o.version) == (rid, state, version)
        ]


def _slow_receiver_main(address, rid, seed, load_delay_s, reports):
    import time

    from weightsync.errors import WeightSyncError
    from weightsync.receiver import TorchReceiver

    out = Reporter(reports)
    model = fault_model(seed)
    receiver = TorchReceiver(model, address, receiver_id=rid)
    begin, load = receiver.target.begin, receiver.target.load
    version = [0, False]  # the version being loaded, and whether it was reported

    def begin_version(manifest):
        version[:] = [manifest.version, False]
        begin(manifest)

    def slow_load(tensors):
        if not version[1]:
            version[1] = True
            out.put(Outcome(rid, "loading", version[0], {}, ""))
        time.sleep(load_delay_s)
        load(tensors)

    receiver.target.begin, receiver.target.load = begin_version, slow_load
    out.put(Outcome(rid, "ready", 0, {}, ""))
    while True:
        try:
            v = receiver.sync(timeout=60)
            out.put(Outcome(rid, "applied", v, digests(model), ""))
        except WeightSyncError as e:
            out.put(Outcome(rid, type(e).__name__, version[0], digests(model), str(e)))


def start_slow_receiver(address: str, rid: str, seed: int, out: Reports, load_delay_s: float):
    """A receiver process holding ``fault_model(seed)`` that syncs until it is ended, each
    bucket's load ``load_delay_s`` late. To ``out``: ``ready`` once registered, ``loading``
    (the version) when a version's first bucket arrived, then ``applied`` or the error's type
    name (with the version it was loading) after each sync."""
    p = children.process(
        _slow_receiver_main, (address, rid, seed, load_delay_s, out.path), daemon=True
    )
    p.start()
    return p


def _fault_publisher_main(address, versions, reports):
    from weightsync.errors import WeightSyncError
    from weightsync.sender import Publisher

    out = Reporter(reports)
    publisher = Publisher(address, connect_timeout_s=30)
    try:
        for v in versions:
            state = fault_model(PUBLISHED_SEED + v).state_dict()
            try:
                publisher.publish(state, v, wait=True, timeout_s=120)
                out.put(Outcome("publisher", "published", v, {}, ""))
            except WeightSyncError as e:
                out.put(Outcome("publisher", type(e).__name__, v, {}, str(e)))
                return
    finally:
        publisher.close()


def start_publisher_process(address: str, versions: list[int], out: Reports):
    """A publisher process publishing ``fault_model(PUBLISHED_SEED + v)`` as each of
    ``versions`` (``wait=True``); reports ``published`` or the error's type name per version to
    ``out`` and stops at its first error."""
    p = children.process(_fault_publisher_main, (address, versions, out.path), daemon=True)
    p.start()
    return p


def stop_children(children, senders: list[subprocess.Popen]) -> None:
    """End a fault test's processes, whatever state they were left in: ``children``
    (multiprocessing) killed, ``senders`` (``sender_process``) resumed if stopped and
    terminated; then the staging segments of a sender killed and never followed by another
    (the only way to leave any) are removed."""
    for proc in children:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
    for proc in senders:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
        proc.wait(20)
    for proc in senders:
        for path in glob.glob(f"/dev/shm/weightsync-*-{proc.pid}-*"):
            os.unlink(path)


# --- one process per rank ----------------------------------------------------------------------


def spawn_ranks(target, args: tuple, world_size: int, timeout_s: float) -> dict[int, object]:
    """Run ``target(rank, *args, out)`` in a child process per rank (``target`` a
    module-level function, which puts ``(rank, result)`` on ``out``); each rank's result.

    Fails the test, with the processes' exit codes, when a rank reports nothing in
    ``timeout_s``; every process is joined (or killed) before returning.
    """
    import pytest

    out = children.queue()
    procs = [children.process(target, (r, *args, out)) for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    try:
        for _ in procs:
            try:
                rank, result = out.get(timeout=timeout_s)
            except queue.Empty:
                codes = {p.pid: p.exitcode for p in procs}
                pytest.fail(f"ranks did not report within {timeout_s} s (exit codes {codes})")
            got[rank] = result
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return got


def parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` while it runs; None once it exited (a zombie no parent
    reaped yet included: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if state in ("Z", "X") else int(ppid)
