"""Issue 16 item 6: Status says what is true.

- weights that may be a mix of two versions show ``dirty``: after the publisher is killed
  mid-version (before: ``failed``) and after the sender is killed mid-version and restarted
  (before: ``idle`` at version 0);
- a receiver's applied version comes from the receiver's hello: an engine restarted under its
  old id holds its initial weights (before: Status showed the old id's version);
- disconnected receivers expire (before: every one ever seen was listed), and the versions
  they took part in keep their outcomes;
- a sender at its stream limit says so (before: "no weightsync sender answers").

Real senders (in-process, or the ``weightsync-sender`` CLI where it is killed), real gRPC
sockets, receivers in threads.
"""

from __future__ import annotations

import glob
import logging
import os
import time

import pytest
import torch

from tests.support import TinyNet, digests, step, sync_in_thread, unix_sender, wait_until
from tests.support.processes import sender_process
from weightsync.errors import ReceiverFailedError, TransportError, WeightSyncError
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher, coordinator
from weightsync.sender.daemon import Sender
from weightsync.v1 import weightsync_pb2 as pb


def big(seed: int) -> TinyNet:
    """Four 1 MiB buckets at a 1 MiB cap: with two staging buffers a version cannot finish
    once its publisher or sender is gone after the first bucket."""
    model = TinyNet(seed=seed)
    model.embed = torch.nn.Parameter(
        torch.randn(60000, 16, generator=torch.Generator().manual_seed(seed))
    )
    return model


def receiver_status(publisher: Publisher, rid: str) -> pb.ReceiverStatus:
    (status,) = [r for r in publisher.status().receivers if r.receiver_id == rid]
    return status


def after_first_load(receiver: TorchReceiver, then) -> None:
    """Call ``then()`` once, right after the receiver wrote its first bucket."""
    load = receiver.target.load

    def load_then(tensors):
        load(tensors)
        receiver.target.load = load
        then()

    receiver.target.load = load_then


def test_a_publisher_killed_mid_version_leaves_its_receivers_dirty(sock_dir):
    trainer, model = big(2), big(1)
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1 << 20, ack_timeout_s=20) as s:
        receiver = TorchReceiver(model, s.address, receiver_id="mixed")
        observer = Publisher(s.address)
        t, results = sync_in_thread(receiver)
        observer.publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
        assert t.finish(30) == [1]

        doomed = Publisher(s.address)
        # The publisher's stream ends mid-version, as when its process is killed.
        after_first_load(receiver, doomed.close)
        t, results = sync_in_thread(receiver)
        step(trainer, 2)
        with pytest.raises(WeightSyncError):
            doomed.publish(trainer.state_dict(), 2, wait=True, timeout_s=30)
        t.finish(30)
        assert isinstance(results[0], ReceiverFailedError), results
        assert receiver.dirty and receiver.applied_version == 1
        status = receiver_status(observer, "mixed")
        assert (status.state, status.applied_version) == ("dirty", 1)

        t, results = sync_in_thread(receiver)
        step(trainer, 3)
        observer.publish(trainer.state_dict(), 3, wait=True, timeout_s=30)
        assert t.finish(30) == [3] and digests(model) == digests(trainer)
        status = receiver_status(observer, "mixed")
        assert (status.state, status.applied_version) == ("idle", 3)
        receiver.close()
        observer.close()


def test_a_sender_killed_mid_version_and_restarted_shows_the_receiver_dirty(sock_dir):
    address = f"unix:{sock_dir}/s.sock"
    trainer, model = big(2), big(1)
    daemon = sender_process(address)
    pids = [daemon.pid]
    try:
        receiver = TorchReceiver(model, address, receiver_id="survivor")
        t, results = sync_in_thread(receiver)
        Publisher(address).publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
        assert t.finish(30) == [1]

        def kill_the_sender():
            daemon.kill()
            daemon.wait(10)

        after_first_load(receiver, kill_the_sender)
        t, results = sync_in_thread(receiver)
        step(trainer, 2)
        with pytest.raises(WeightSyncError):
            Publisher(address).publish(trainer.state_dict(), 2, wait=True, timeout_s=30)
        t.finish(30)
        assert isinstance(results[0], TransportError), results
        assert receiver.dirty and receiver.applied_version == 1

        daemon = sender_process(address)
        pids.append(daemon.pid)
        publisher = Publisher(address)
        # The new sender never saw version 1: what Status says comes from the hello.
        status = wait_until(
            lambda: [r for r in publisher.status().receivers if r.connected],
            20,
            "the receiver did not register again",
            0.1,
        )[0]
        assert (status.receiver_id, status.state, status.applied_version) == (
            "survivor",
            "dirty",
            1,
        )
        t, results = sync_in_thread(receiver)
        publisher.publish(trainer.state_dict(), 2, wait=True, timeout_s=30)
        assert t.finish(30) == [2] and digests(model) == digests(trainer)
        status = receiver_status(publisher, "survivor")
        assert (status.state, status.applied_version) == ("idle", 2)
        receiver.close()
        publisher.close()
    finally:
        daemon.kill()
        for pid in pids:  # a killed daemon cannot unlink its shared memory
            for path in glob.glob(f"/dev/shm/weightsync-*-{pid}-*"):
                os.unlink(path)


def test_an_engine_restarted_under_its_old_id_shows_its_own_version(sender):
    trainer = TinyNet(seed=2)
    publisher = Publisher(sender.address)
    first = TorchReceiver(TinyNet(seed=1), sender.address, receiver_id="engine-0")
    t, _ = sync_in_thread(first)
    publisher.publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
    assert t.finish(30) == [1]
    assert receiver_status(publisher, "engine-0").applied_version == 1
    first.close()
    wait_until(lambda: not receiver_status(publisher, "engine-0").connected, 10, "still connected")

    # The engine restarts with its initial weights, under the same id.
    again = TorchReceiver(TinyNet(seed=1), sender.address, receiver_id="engine-0")
    status = receiver_status(publisher, "engine-0")
    assert (status.connected, status.state, status.applied_version) == (True, "idle", 0)
    again.close()
    publisher.close()


def test_disconnected_receivers_expire_and_their_versions_keep_their_outcomes(sock_dir):
    trainer = TinyNet(seed=2)
    with unix_sender(bucket_size_bytes=4096, receiver_ttl_s=1.0, max_disconnected_receivers=4) as s:
        publisher = Publisher(s.address)
        gone = TorchReceiver(TinyNet(seed=1), s.address, receiver_id="gone")
        t, _ = sync_in_thread(gone)
        publisher.publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
        assert t.finish(30) == [1]
        gone.close()
        wait_until(lambda: not receiver_status(publisher, "gone").connected, 10, "still there")
        wait_until(
            lambda: "gone" not in {r.receiver_id for r in publisher.status().receivers},
            10,
            "a receiver disconnected past receiver_ttl_s is still listed",
            0.1,
        )
        outcome = publisher.wait_applied(1, timeout_s=5).receivers
        assert [(o.receiver_id, o.state) for o in outcome] == [("gone", "applied")]

        # Reconnecting engines (a new id each time) are capped well within the TTL too.
        for i in range(12):
            TorchReceiver(TinyNet(seed=1), s.address, receiver_id=f"flap-{i:02d}").close()
        # The next Status prunes: the newest 4 disconnected ones stay.
        wait_until(
            lambda: sum(not r.connected for r in publisher.status().receivers) == 4,
            10,
            "the sender does not cap its disconnected receivers",
            0.1,
        )
        ids = sorted(r.receiver_id for r in publisher.status().receivers)
        assert ids == [f"flap-{i:02d}" for i in range(8, 12)]
        publisher.close()


def test_a_sender_at_its_stream_limit_says_so_and_still_answers_status(sock_dir):
    trainer = TinyNet(seed=2)
    with unix_sender(bucket_size_bytes=4096, max_streams=2) as s:
        held = [TorchReceiver(TinyNet(seed=1), s.address, receiver_id=f"r{i}") for i in range(2)]
        with pytest.raises(TransportError, match=r"stream limit \(2 streams.*MAX_STREAMS"):
            TorchReceiver(TinyNet(seed=1), s.address, receiver_id="third")
        publisher = Publisher(s.address)
        assert len(publisher.status().receivers) == 2  # unary calls still served
        with pytest.raises(TransportError, match=r"stream limit \(2 streams"):
            publisher.publish(trainer.state_dict(), 1, timeout_s=10)
        held.pop().close()
        wait_until(
            lambda: sum(r.connected for r in publisher.status().receivers) == 1, 10, "not closed"
        )
        # A freed stream is taken again (the refusals did not leak a count).
        t, _ = sync_in_thread(held[0])
        publisher.publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
        assert t.finish(30) == [1]
        held[0].close()
        publisher.close()


def test_a_versions_planning_is_timed_in_status_and_its_log_line_and_counted_in_it(
    sock_dir, monkeypatch, caplog
):
    """Planning runs after the last rank joined and before the version starts: a slow plan (a
    new layout of a large model) shows as ``plan_s`` and is part of ``complete_s``."""
    plan = coordinator.plan_version

    def slow_plan(*args, **kwargs):
        time.sleep(0.3)
        return plan(*args, **kwargs)

    monkeypatch.setattr(coordinator, "plan_version", slow_plan)
    trainer = TinyNet(seed=2)
    with caplog.at_level(logging.INFO, logger="weightsync.sender"):
        with Sender(f"unix:{sock_dir}/p.sock") as sender:
            receiver = TorchReceiver(TinyNet(seed=1), sender.address, receiver_id="r")
            syncs, _ = sync_in_thread(receiver, n=1)
            with Publisher(sender.address) as publisher:
                publisher.publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
                (version,) = publisher.status().versions
            assert syncs.finish(30) == [1]
            receiver.close()
    assert 0.3 <= version.plan_s < version.complete_s
    (line,) = [r for r in caplog.records if getattr(r, "event", None) == "version_finished"]
    assert line.plan_s == round(version.plan_s, 6)
    assert f"planned {version.plan_s:.3f} s" in line.getMessage()
