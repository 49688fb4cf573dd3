"""A sender killed mid-version, after receivers on other hosts wrote some of it (issue 12,
receiver side): the version fails on every receiver, naming the sender and saying the weights
are dirty, and after the sender restarts the next version heals every receiver.

Every part is its own process, as in ``tests/faults/test_kills.py``: two ``weightsync-sender``
CLIs with host ids "trainer-a" and "trainer-b", a publisher process per sender publishing its
part (``Publisher.publish(part=...)``), and two receivers with host ids "engine-a" and
"engine-b" (``TorchReceiver(model, [address_a, address_b])``), which get the bytes by
broadcast over gloo. The same kill before any byte of the version was written, with a Megatron
trainer spanning hosts (PP=2 and EP=2), and versions split over two senders applying bit for
bit, are in ``test_megatron_hosts.py``. A sender SIGSTOPped mid-version fails the version the
same way once the keepalives notice (its socket stays open), and heals when it resumes. Last, a
publisher kept across its sender's restart between versions publishes the next version to the
new sender.
"""

from __future__ import annotations

import os
import signal

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
    start_slow_receiver,
    stop_children,
)
from tests.support.waiting import wait_until

SENDERS = ("trainer-a", "trainer-b")
RECEIVERS = ("engine-a", "engine-b")
PARTS = (("embed",), ("proj", "norm", "counts", "scale"))
"""The tensors of ``fault_model`` each sender sends: trainer-a the 4-bucket embedding,
trainer-b the rest (one bucket)."""
LOAD_DELAY_S = 0.3
ACK_TIMEOUT_S = 10


def expected(version: int) -> dict[str, str]:
    return digests(fault_model(PUBLISHED_SEED + version))


def _part_publisher_main(address, index, versions, reports):
    from weightsync.buckets import TensorSpec
    from weightsync.errors import WeightSyncError
    from weightsync.manifest import VersionPartSpec, plan_digest
    from weightsync.sender import Publisher

    out = Reporter(reports)
    who = f"publisher-{SENDERS[index]}"
    publisher = Publisher(address, connect_timeout_s=30)
    try:
        for v in versions:
            state = fault_model(PUBLISHED_SEED + v).state_dict()
            specs = [[TensorSpec.of(n, state[n]) for n in names] for names in PARTS]
            part = VersionPartSpec(
                index, len(PARTS), SENDERS[index], plan_digest(specs), len(state)
            )
            mine = {n: state[n] for n in PARTS[index]}
            try:
                publisher.publish(mine, v, wait=True, timeout_s=120, part=part)
                out.put(Outcome(who, "published", v, {}, ""))
            except WeightSyncError as e:
                out.put(Outcome(who, type(e).__name__, v, {}, str(e)))
                return
    finally:
        publisher.close()


class Rig:
    """Two sender processes, two receiver processes registered with both, and publishers."""

    def __init__(self, sock_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.addresses = [f"unix:{sock_dir}/{host}.sock" for host in SENDERS]
        self.out = fault_reports(f"{sock_dir}/reports.sock")
        self.inbox = Inbox(self.out)
        self.senders = [self.start_sender(i) for i in range(len(SENDERS))]
        self.receivers = []
        for i, rid in enumerate(RECEIVERS):
            # Spawned processes take the environment as it is when they start.
            with monkeypatch.context() as env:
                env.setenv("WEIGHTSYNC_HOST_ID", rid)
                self.receivers.append(
                    start_slow_receiver(self.addresses, rid, 100 + i, self.out, LOAD_DELAY_S)
                )
        self.inbox.wait(
            lambda seen: all(self.inbox.find(rid, "ready", 0) for rid in RECEIVERS),
            90,
            "the receivers did not register with both senders",
        )
        self.publishers: list = []

    def start_sender(self, index: int):
        return sender_process(self.addresses[index], {"WEIGHTSYNC_HOST_ID": SENDERS[index]})

    def publish(self, versions: list[int]) -> None:
        """A publisher process per sender, each publishing its part of every version."""
        for i, address in enumerate(self.addresses):
            proc = children.process(
                _part_publisher_main, (address, i, versions, self.out.path), daemon=True
            )
            proc.start()
            self.publishers.append(proc)

    def published(self, index: int, version: int) -> tuple[str, str]:
        """How sender ``index``'s publisher reported ``version``: (state, error message)."""
        who = f"publisher-{SENDERS[index]}"
        return self.inbox.wait(
            lambda seen: next(
                (
                    (o.state, o.error)
                    for _, o in seen
                    if (o.receiver_id, o.version) == (who, version)
                ),
                None,
            ),
            120,
            f"{who} did not report version {version}",
        )

    def applied_everywhere(self, version: int) -> None:
        """Every receiver applied ``version``, bit-exact."""
        self.inbox.wait(
            lambda seen: all(self.inbox.find(rid, "applied", version) for rid in RECEIVERS),
            120,
            f"version {version} was not applied by every receiver",
        )
        for rid in RECEIVERS:
            ((_, outcome),) = self.inbox.find(rid, "applied", version)
            assert outcome.digests == expected(version), f"{rid} differs from version {version}"

    def data_paths(self, index: int) -> dict[str, str]:
        from weightsync.sender import Publisher

        with Publisher(self.addresses[index], connect_timeout_s=30) as client:
            return {r.receiver_id: r.data_path for r in client.status().receivers if r.connected}

    def wait_registered(self, index: int) -> None:
        wait_until(
            lambda: set(self.data_paths(index)) == set(RECEIVERS),
            60,
            f"receivers did not register with {SENDERS[index]}",
            interval=0.2,
        )

    def loading_everywhere(self, version: int) -> None:
        """Every receiver wrote part of ``version`` (so each reports its weights dirty if the
        version then fails)."""
        self.inbox.wait(
            lambda seen: all(self.inbox.find(rid, "loading", version) for rid in RECEIVERS),
            60,
            f"version {version} never loaded on every receiver",
        )

    def ends(self, version: int, message: str) -> list[Outcome]:
        """Each receiver's outcome of ``version`` (``RECEIVERS`` order), once all reported."""

        def reported(seen) -> list[Outcome] | None:
            got = [
                next(
                    (
                        o
                        for _, o in seen
                        if (o.receiver_id, o.version) == (rid, version)
                        and o.state not in ("loading", "ready")
                    ),
                    None,
                )
                for rid in RECEIVERS
            ]
            return got if all(got) else None

        return self.inbox.wait(reported, 60, message)

    def heals(self, version: int) -> None:
        """Once the receivers are back with trainer-a, ``version`` applies everywhere."""
        self.wait_registered(0)
        self.publish([version])
        for index in range(len(SENDERS)):
            state, error = self.published(index, version)
            assert state == "published", error  # the whole message: it names who failed
        self.applied_everywhere(version)

    def close(self) -> None:
        stop_children([*self.publishers, *self.receivers], self.senders)
        self.out.close()


@pytest.fixture
def rig(sock_dir, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_ACK_TIMEOUT_S", str(ACK_TIMEOUT_S))
    rig = Rig(sock_dir, monkeypatch)
    try:
        yield rig
    finally:
        rig.close()


def assert_failed_naming_trainer_a(rig: Rig, outcomes: list[Outcome]) -> None:
    for got in outcomes:
        assert got.state == "TransportError", got.error
        assert got.error.startswith(
            f"version 2 failed on receiver {got.receiver_id}: part 0 of 2 from sender "
            f"trainer-a at {rig.addresses[0]}"
        ), got.error


@pytest.mark.timeout(300)
def test_a_sender_killed_mid_version_fails_it_everywhere_and_the_next_version_heals(rig):
    rig.publish([1, 2])
    rig.applied_everywhere(1)
    rig.loading_everywhere(2)
    victim = rig.senders[0]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)

    # Every receiver fails version 2, naming the killed sender; none commits it.
    failed = rig.ends(2, "the receivers did not report version 2's end")
    assert_failed_naming_trainer_a(rig, failed)
    for got in failed:
        assert "weights are dirty" in got.error
    # The surviving sender's publisher learns that version 2 failed.
    state, error = rig.published(1, 2)
    assert state == "ReceiverFailedError"
    assert "trainer-a" in error
    assert rig.published(0, 2)[0] != "published"
    # The killed sender restarts on the same address; the receivers register again.
    rig.senders.append(rig.start_sender(0))
    rig.heals(3)
    for rid in RECEIVERS:
        assert not rig.inbox.find(rid, "applied", 2), f"{rid} applied version 2"


@pytest.mark.timeout(300)
def test_a_stopped_sender_fails_the_version_everywhere_and_heals_once_it_resumes(rig):
    """SIGSTOP, not a kill: the stopped sender's socket stays open, so only the control
    plane's keepalives (10 s + 5 s) tell the receivers it is gone; they must not wait for it
    for ever with half a version written."""
    rig.publish([1, 2])
    rig.applied_everywhere(1)
    rig.loading_everywhere(2)
    victim = rig.senders[0]
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        failed = rig.ends(2, "the receivers still wait for the stopped sender")
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    assert_failed_naming_trainer_a(rig, failed)
    assert rig.published(1, 2)[0] == "ReceiverFailedError"
    assert rig.published(0, 2)[0] != "published"
    # The resumed sender takes the receivers back; the next version applies everywhere.
    rig.heals(3)


def test_a_publisher_kept_across_a_sender_restart_publishes_to_the_new_sender(sock_dir):
    """A trainer rank's publisher outlives its sender's restart between versions (as the
    Megatron ranks' do): the next version goes to the new sender, not to the stream the old
    one ended."""
    import torch

    from weightsync.sender import Publisher
    from weightsync.sender.daemon import Sender

    address = f"unix:{sock_dir}/s.sock"
    weights = {"w": torch.arange(8.0)}
    with Sender(address) as sender, Publisher(address) as publisher:
        publisher.publish(weights, 1)
        sender.close()
        with Sender(address) as restarted:
            assert publisher.publish(weights, 2).version == 2
            assert [v.version for v in restarted.coordinator.status().versions] == [2]


def test_a_publisher_that_has_not_seen_its_stream_end_yet_publishes_to_the_restarted_sender(
    sock_dir, monkeypatch
):
    """The race the test above can lose: the sender restarted, but the publisher's stream
    does not say it ended yet (gRPC learns it on its own threads), so the next version goes
    on it and finds the sender unreachable. Nothing of that version reached a sender: it
    goes again on a new stream, once. The window is forced by having the stream's call
    report itself not done. Its second go waits for the tensors' ready events too (on the
    CPU, before the begin: a stand-in event that counts the looks at it)."""
    import torch

    from weightsync.sender import Publisher
    from weightsync.sender.daemon import Sender

    class Event:
        looks = 0

        def query(self) -> bool:
            Event.looks += 1
            return True

    address = f"unix:{sock_dir}/s.sock"
    weights = {"w": torch.arange(8.0)}
    with Sender(address) as sender, Publisher(address) as publisher:
        publisher.publish(weights, 1)
        stale = publisher._stream
        sender.close()
        monkeypatch.setattr(type(stale.call), "done", lambda call: False)
        with Sender(address) as restarted:
            assert publisher.publish(weights, 2, ready={"w": Event()}).version == 2
            assert Event.looks == 2  # once before each go
            assert publisher._stream is not stale
            assert [v.version for v in restarted.coordinator.status().versions] == [2]
