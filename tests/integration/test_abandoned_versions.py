"""A version whose publisher gave up while it queued behind another is never started: the
sender used to start it anyway, receivers failed with "unexpected start inside version N",
and the next good version failed everywhere after the ack timeout. A version whose driving
fails on a bug is abandoned, and the versions after it still run."""

from __future__ import annotations

import threading
import time

import pytest

from tests.support import TinyNet, digests, step, sync_in_thread, wait_until
from weightsync.errors import SyncTimeoutError, WeightSyncError
from weightsync.receiver import ReceiverCore
from weightsync.receiver.torch_receiver import TorchModuleTarget
from weightsync.sender import Publisher, Sender
from weightsync.sender.version import Version


class GatedTarget(TorchModuleTarget):
    """Holds every bucket until ``gate`` opens (so the version holds the sender's driver),
    and records each version it began."""

    def __init__(self, module) -> None:
        super().__init__(module)
        self.gate = threading.Event()
        self.begun: list[int] = []

    def begin(self, manifest) -> None:
        self.begun.append(manifest.version)
        super().begin(manifest)

    def load(self, tensors) -> None:
        self.gate.wait(30)
        super().load(tensors)


def test_a_version_given_up_while_queued_is_never_started(sock_dir):
    ack_timeout_s = 30
    with Sender(
        f"unix:{sock_dir}/s.sock",
        bucket_size_bytes=1024,
        num_buffers=2,
        ack_timeout_s=ack_timeout_s,
    ) as sender:
        co = sender.coordinator
        model, trainer = TinyNet(seed=1), TinyNet(seed=2)
        target = GatedTarget(model)
        receiver = ReceiverCore(target, sender.address, receiver_id="gated")
        syncs, _ = sync_in_thread(receiver, n=2)
        first, queued = Publisher(sender.address), Publisher(sender.address)

        # Version 1 holds the driver: more buckets than staging buffers, none acked yet.
        step(trainer, 1)
        one = threading.Thread(target=first.publish, args=(trainer.state_dict(), 1))
        one.start()
        wait_until(lambda: co.run_of(1) is not None, 10, "version 1 to begin")
        with pytest.raises(SyncTimeoutError):
            queued.publish(trainer.state_dict(), 2, timeout_s=1)
        wait_until(lambda: co.run_of(2).done, 10, "version 2 to be abandoned")

        target.gate.set()
        one.join(30)
        step(trainer, 3)
        began = time.monotonic()
        result = first.publish(trainer.state_dict(), 3, wait=True, timeout_s=ack_timeout_s / 3)
        assert time.monotonic() - began < ack_timeout_s / 3
        assert [o.state for o in result.status.receivers] == ["applied"]
        assert syncs.finish(30) == [1, 3]
        assert target.begun == [1, 3]  # version 2's start never reached it
        assert digests(model) == digests(trainer)
        versions = {v.version: v for v in co.status().versions}
        assert [versions[v].state for v in (1, 2, 3)] == ["complete", "failed", "complete"]
        assert versions[2].receivers == []  # never addressed to anyone
        assert versions[2].abandoned.message == "publisher rank 0 closed its stream"
        assert not versions[3].HasField("abandoned")
        for publisher in (first, queued):
            publisher.close()
        receiver.close()


def test_a_bug_driving_a_version_abandons_it_and_the_next_version_runs(sock_dir, monkeypatch):
    """One thread drives every version: an exception no check foresaw must fail its version
    (the publisher hears it at once) and leave the thread driving the next ones."""
    start = Version.start

    def buggy_start(self, driver, device):
        if self.version == 2:
            raise RuntimeError("injected bug")
        return start(self, driver, device)

    monkeypatch.setattr(Version, "start", buggy_start)
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024) as sender:
        model, trainer = TinyNet(seed=1), TinyNet(seed=2)
        receiver = ReceiverCore(TorchModuleTarget(model), sender.address, receiver_id="r")
        syncs, _ = sync_in_thread(receiver, n=2)
        with Publisher(sender.address) as publisher:
            for version in (1, 2, 3):
                step(trainer, version)
                if version == 2:
                    with pytest.raises(WeightSyncError, match="RuntimeError: injected bug"):
                        publisher.publish(trainer.state_dict(), 2, wait=True, timeout_s=30)
                else:
                    publisher.publish(trainer.state_dict(), version, wait=True, timeout_s=30)
            assert syncs.finish(30) == [1, 3]
            assert digests(model) == digests(trainer)
            states = {v.version: v.state for v in sender.coordinator.status().versions}
            assert states == {1: "complete", 2: "failed", 3: "complete"}
        receiver.close()


def test_a_version_begun_while_the_sender_closes_fails_at_once(sock_dir):
    """The driver thread ends when the sender closes: a version planned after that must fail
    its publisher at once, not wait out the publish timeout undriven."""
    timeout_s = 20
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024) as sender:
        trainer = TinyNet(seed=2)
        with Publisher(sender.address) as publisher:
            publisher.publish(trainer.state_dict(), 1, timeout_s=timeout_s)
            sender.coordinator.close()  # what Sender.close does first; its server still runs
            began = time.monotonic()
            with pytest.raises(WeightSyncError, match="2 abandoned: the sender is shutting"):
                publisher.publish(trainer.state_dict(), 2, timeout_s=timeout_s)
            assert time.monotonic() - began < timeout_s / 4
