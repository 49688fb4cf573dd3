"""kill -9 and SIGSTOP of a receiver, the publisher and the sender, each mid-version, each
followed by more versions that apply bit-exact everywhere (issue 16, the fault suite).

Every part is its own process: the ``weightsync-sender`` CLI, two receivers and a publisher
(``tests.support.processes``). A version is four 1 MiB buckets and every receiver loads each
bucket ``LOAD_DELAY_S`` late, so a version lasts about two seconds; the fault strikes when a
receiver reports that version 2's first bucket arrived. It is then mid-version: the publisher
has not returned from ``publish(2, wait=True)`` and, with two staging buffers, buckets 3 and
4 are not packed yet (a slot frees only when every receiver loaded its bucket).

Already covered in ``tests/integration/test_faults.py`` and not repeated here: a receiver
that exits by itself mid-version (``test_receiver_dying_mid_version_fails_alone...``), a
receiver that never syncs (``test_stalled_receiver_times_out...``), the sender killed
mid-version with a receiver in a thread, then one version (``test_a_killed_sender_fails...``).
"""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest

from tests.support import children
from tests.support.models import digests
from tests.support.processes import (
    PUBLISHED_SEED,
    Inbox,
    Outcome,
    Reporter,
    fault_model,
    fault_reports,
    sender_process,
    start_publisher_process,
    start_slow_receiver,
    stop_children,
)

LOAD_DELAY_S = 0.4
ACK_TIMEOUT_S = 5
"""The sender's ``--ack-timeout-s``: how long a stopped receiver holds the others up."""
STOPPED_S = 2.0
"""How long a stopped process stays stopped before SIGCONT or SIGKILL."""
RECEIVERS = ("r0", "r1")
VICTIM_RECEIVER = "r1"
LAST_VERSION = 4


def expected(version: int) -> dict[str, str]:
    return digests(fault_model(PUBLISHED_SEED + version))


class Rig:
    """A sender process, the receiver processes and the publisher processes of one test."""

    def __init__(self, sock_dir: str) -> None:
        self.address = f"unix:{sock_dir}/s.sock"
        self.out = fault_reports(f"{sock_dir}/reports.sock")
        self.inbox = Inbox(self.out)
        self.senders = [sender_process(self.address)]
        self.receivers = {
            rid: start_slow_receiver(self.address, rid, 100 + i, self.out, LOAD_DELAY_S)
            for i, rid in enumerate(RECEIVERS)
        }
        self.wait_ready(RECEIVERS)
        self.publishers: list = []

    def wait_ready(self, ids, before: int = 0) -> None:
        """Wait until each of ``ids`` reported ``ready`` more than ``before`` times."""
        self.inbox.wait(
            lambda seen: all(len(self.inbox.find(rid, "ready", 0)) > before for rid in ids),
            90,
            f"receivers {ids} did not register",
        )

    def restart_receiver(self, rid: str, seed: int) -> None:
        """A new engine process under the same id."""
        before = len(self.inbox.find(rid, "ready", 0))
        self.receivers[rid] = start_slow_receiver(self.address, rid, seed, self.out, LOAD_DELAY_S)
        self.wait_ready([rid], before)

    def publish(self, versions: list[int]) -> None:
        self.publishers.append(start_publisher_process(self.address, versions, self.out))

    def wait_registered(self) -> None:
        """Every receiver is connected to the (new) sender, so a new version reaches all."""
        from weightsync.sender import Publisher

        with Publisher(self.address, connect_timeout_s=30) as client:
            deadline = time.monotonic() + 60
            while {r.receiver_id for r in client.status().receivers if r.connected} != set(
                RECEIVERS
            ):
                assert time.monotonic() < deadline, "receivers did not register again"
                time.sleep(0.1)

    def published(self, version: int) -> tuple[float, str]:
        """When the publisher reported ``version`` and how (``published`` or an error)."""
        return self.inbox.wait(
            lambda seen: next(
                (
                    (t, o.state)
                    for t, o in seen
                    if o.receiver_id == "publisher" and o.version == version
                ),
                None,
            ),
            120,
            f"the publisher did not report version {version}",
        )

    def applied_everywhere(self, version: int) -> list[float]:
        """Wait until every receiver applied ``version``; assert it bit-exact; when each did."""
        self.inbox.wait(
            lambda seen: all(self.inbox.find(rid, "applied", version) for rid in RECEIVERS),
            120,
            f"version {version} was not applied by every receiver",
        )
        want = expected(version)
        times = []
        for rid in RECEIVERS:
            ((t, outcome),) = self.inbox.find(rid, "applied", version)
            assert outcome.digests == want, f"{rid} differs from version {version}"
            times.append(t)
        return times

    def close(self) -> None:
        stop_children([*self.publishers, *self.receivers.values()], self.senders)
        self.out.close()


@pytest.fixture
def rig(sock_dir, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_ACK_TIMEOUT_S", str(ACK_TIMEOUT_S))
    rig = Rig(sock_dir)
    try:
        yield rig
    finally:
        rig.close()


def start_mid_version_2(rig: Rig, rid: str = "r0") -> float:
    """Publish versions 1..LAST_VERSION; return once ``rid`` reports version 2's first bucket
    loading, after version 1 applied everywhere."""
    rig.publish(list(range(1, LAST_VERSION + 1)))
    rig.applied_everywhere(1)
    ((t, _),) = rig.inbox.wait(
        lambda seen: rig.inbox.find(rid, "loading", 2), 60, f"{rid} never loaded version 2"
    )
    return t


def assert_version_2_failed_and_healed(rig: Rig, survivors: tuple[str, ...] = ()) -> None:
    """Version 2 applied nowhere but on ``survivors``; a new publisher's 3..LAST apply
    bit-exact on every receiver."""
    for rid in RECEIVERS:
        if rid not in survivors:
            assert not rig.inbox.find(rid, "applied", 2), f"{rid} applied version 2"
    rig.wait_registered()
    rig.publish(list(range(3, LAST_VERSION + 1)))
    for version in range(3, LAST_VERSION + 1):
        assert rig.published(version)[1] == "published"
        rig.applied_everywhere(version)


@pytest.mark.parametrize("how", ["kill", "stop_then_cont", "stop_then_kill"])
def test_receiver(rig, how):
    start_mid_version_2(rig, VICTIM_RECEIVER)
    victim = rig.receivers[VICTIM_RECEIVER]
    if how == "kill":
        os.kill(victim.pid, signal.SIGKILL)
    else:
        os.kill(victim.pid, signal.SIGSTOP)
    # The others finish version 2; the victim fails alone (stopped: after the ack timeout).
    _, result = rig.published(2)
    assert result == "ReceiverFailedError"
    ((_, survivor),) = rig.inbox.wait(
        lambda seen: rig.inbox.find("r0", "applied", 2), 30, "r0 did not apply version 2"
    )
    assert survivor.digests == expected(2)
    if how == "stop_then_cont":
        os.kill(victim.pid, signal.SIGCONT)
    else:
        if how == "stop_then_kill":
            os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        rig.restart_receiver(VICTIM_RECEIVER, 101)
    assert_version_2_failed_and_healed(rig, survivors=("r0",))


@pytest.mark.parametrize("how", ["kill", "stop_then_cont", "stop_then_kill"])
def test_publisher(rig, how):
    start_mid_version_2(rig)
    (victim,) = rig.publishers
    if how == "kill":
        os.kill(victim.pid, signal.SIGKILL)
    else:
        os.kill(victim.pid, signal.SIGSTOP)
        time.sleep(STOPPED_S)
        # Mid-version for real: nobody could finish version 2 without the publisher.
        assert not any(rig.inbox.find(rid, "applied", 2) for rid in RECEIVERS)
        os.kill(victim.pid, signal.SIGCONT if how == "stop_then_cont" else signal.SIGKILL)
    if how == "stop_then_cont":
        for version in range(2, LAST_VERSION + 1):
            assert rig.published(version)[1] == "published"
            rig.applied_everywhere(version)
        return
    victim.join(10)
    # The sender sees the publisher's stream break: version 2 fails on every receiver.
    rig.inbox.wait(
        lambda seen: all(
            any(o.receiver_id == rid and o.state not in ("loading", "applied") for _, o in seen)
            for rid in RECEIVERS
        ),
        60,
        "the receivers were not told that version 2 failed",
    )
    assert_version_2_failed_and_healed(rig)


@pytest.mark.parametrize("how", ["kill", "stop_then_cont", "stop_then_kill"])
def test_sender(rig, how):
    start_mid_version_2(rig)
    (victim,) = rig.senders
    if how == "kill":
        os.kill(victim.pid, signal.SIGKILL)
    else:
        os.kill(victim.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        time.sleep(STOPPED_S)
        os.kill(victim.pid, signal.SIGCONT if how == "stop_then_cont" else signal.SIGKILL)
    if how == "stop_then_cont":
        # Nothing of version 2 could finish while the sender was stopped: it was mid-version.
        assert min(rig.applied_everywhere(2)) > stopped + STOPPED_S
        for version in range(3, LAST_VERSION + 1):
            rig.applied_everywhere(version)
        return
    victim.wait(10)
    assert rig.published(2)[1] != "published"
    # A new sender on the same address: the receivers register again by themselves, and it
    # reclaims the staging its killed predecessor left in /dev/shm.
    rig.senders.append(sender_process(rig.address))
    assert_version_2_failed_and_healed(rig)
    assert not glob.glob(f"/dev/shm/weightsync-*-{victim.pid}-*")


BIGGER_THAN_A_PIPE = 100_000
"""Bytes of a report that a pipe (64 KiB) cannot take in one write."""


def _report_twice(path: str) -> None:
    out = Reporter(path)
    out.put(Outcome("victim", "loading", 2, {}, ""))
    out.put(Outcome("victim", "error", 2, {}, "x" * BIGGER_THAN_A_PIPE))
    time.sleep(60)


def _report_ready(path: str) -> None:
    Reporter(path).put(Outcome("other", "ready", 0, {}, ""))


@pytest.mark.timeout(60)
def test_a_process_stopped_mid_report_holds_back_no_other_report(sock_dir):
    """The window ``test_receiver``'s stop cases strike in: a process stopped right after it
    reported, maybe mid-way through its next report. With the reports on one multiprocessing
    queue, its feeder thread held the queue's write lock while its big report filled the pipe;
    stopped there, no other process's report ever came (the publisher's version 2 and r0's
    'applied' waited 120 s)."""
    reports = fault_reports(f"{sock_dir}/reports.sock")
    inbox = Inbox(reports)
    victim = children.process(_report_twice, (reports.path,), daemon=True)
    other = children.process(_report_ready, (reports.path,), daemon=True)
    try:
        victim.start()
        inbox.wait(lambda seen: inbox.find("victim", "loading", 2), 30, "no 'loading'")
        time.sleep(0.5)  # its second report under way
        os.kill(victim.pid, signal.SIGSTOP)
        other.start()
        inbox.wait(lambda seen: inbox.find("other", "ready", 0), 30, "the other's report")
    finally:
        for proc in (victim, other):
            # is_alive() reads an exit first: a forkserver child's pid is free for reuse once
            # it exited, and multiprocessing's kill() sends the signal without looking.
            if proc.pid is not None and proc.is_alive():
                proc.kill()
            if proc.pid is not None:
                proc.join(10)
        reports.close()
