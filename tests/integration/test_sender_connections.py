"""Status, metrics and logs follow publishers' and receivers' streams as they come and go."""

from __future__ import annotations

import gc
import logging
import queue

import torch

from tests.support import TinyNet, sync_in_thread, wait_until
from weightsync.control.client import connect
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher
from weightsync.v1 import weightsync_pb2 as pb


def _gauge(sender, name: str) -> float | None:
    return sender.metrics.registry.get_sample_value(name)


def _records(caplog, event: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "weightsync.sender" and getattr(r, "event", None) == event
    ]


def test_status_and_gauges_drop_publishers_whose_streams_ended(sender):
    a0 = Publisher(sender.address, publisher_id="a", rank=0, world_size=2)
    a1 = Publisher(sender.address, publisher_id="a", rank=1, world_size=2)
    b = Publisher(sender.address, publisher_id="b")
    b.publish({"w": torch.ones(4)}, 1)  # opens b's stream (kept across versions)
    for p in (a0, a1):
        p._stream_for(torch.device("cpu"))  # a rank's stream opens at its first publish

    def publishers():
        return [
            (p.publisher_id, p.ranks_connected, p.world_size, p.device)
            for p in sender.coordinator.status().publishers
        ]

    both = [("a", 2, 2, "cpu"), ("b", 1, 1, "cpu")]
    wait_until(lambda: publishers() == both, 10, f"Status.publishers to be {both}")
    assert _gauge(sender, "weightsync_publishers_connected") == 3
    a1.close()
    wait_until(
        lambda: publishers() == [("a", 1, 2, "cpu"), ("b", 1, 1, "cpu")], 10, "a rank 1 gone"
    )
    a0.close()
    b.close()
    wait_until(lambda: publishers() == [], 10, "every publisher gone from Status")
    assert _gauge(sender, "weightsync_publishers_connected") == 0


def test_receivers_connected_gauge_follows_receivers(sender):
    assert _gauge(sender, "weightsync_receivers_connected") in (None, 0)
    r1 = TorchReceiver(TinyNet(seed=1), sender.address, receiver_id="r1")
    r2 = TorchReceiver(TinyNet(seed=1), sender.address, receiver_id="r2")
    wait_until(lambda: _gauge(sender, "weightsync_receivers_connected") == 2, 10, "2 receivers")
    r1.close()
    wait_until(lambda: _gauge(sender, "weightsync_receivers_connected") == 1, 10, "1 receiver")
    r2.close()
    wait_until(lambda: _gauge(sender, "weightsync_receivers_connected") == 0, 10, "0 receivers")


def test_a_receiver_dropped_unclosed_still_leaves(sender):
    """A receiver that goes out of scope (a function's local, a process that exits) leaves
    in order: a dropped one used to hold its stream open until the process died, losing the
    last "applied" it had queued."""
    receiver = TorchReceiver(TinyNet(seed=1), sender.address, receiver_id="dropped")
    wait_until(lambda: _gauge(sender, "weightsync_receivers_connected") == 1, 10, "1 receiver")
    del receiver
    gc.collect()
    wait_until(lambda: _gauge(sender, "weightsync_receivers_connected") == 0, 10, "it left")


def test_one_log_line_per_connect_leave_and_finished_version(sender, caplog):
    caplog.set_level(logging.INFO, logger="weightsync.sender")
    receiver = TorchReceiver(TinyNet(seed=1), sender.address, receiver_id="rx")
    t, results = sync_in_thread(receiver)
    publisher = Publisher(sender.address, publisher_id="trainer")
    status = publisher.publish(TinyNet(seed=2).state_dict(), 1, wait=True, timeout_s=30).status
    t.finish(30)
    wait_until(lambda: _records(caplog, "version_finished"), 10, "the version's log line")
    receiver.close()
    publisher.close()
    wait_until(
        lambda: _records(caplog, "receiver_left") and _records(caplog, "publisher_left"),
        10,
        "the leave lines",
    )

    (joined,) = _records(caplog, "receiver_connected")
    assert joined.getMessage().startswith(
        "receiver rx connected: engine torch, rank 0, device cpu, host "
    )
    assert joined.getMessage().endswith("(this host), data path map")
    assert (joined.receiver_id, joined.engine, joined.data_path) == ("rx", "torch", "map")

    (left,) = _records(caplog, "receiver_left")
    assert left.getMessage() in (
        "receiver rx left (closed its stream): applied version 1, was idle",
        "receiver rx left (disconnected): applied version 1, was idle",
        "receiver rx left (its stream broke): applied version 1, was idle",
    )

    (pjoined,) = _records(caplog, "publisher_connected")
    assert (
        pjoined.getMessage() == "publisher trainer rank 0/1 connected: device cpu; last version 0"
    )
    (pleft,) = _records(caplog, "publisher_left")
    assert pleft.getMessage().startswith("publisher trainer rank 0 left (")
    assert (pleft.publisher_id, pleft.rank) == ("trainer", 0)

    (done,) = _records(caplog, "version_finished")
    message = done.getMessage()
    assert "\n" not in message
    mb = status.total_bytes / 1e6
    assert message.startswith(
        f"version 1 complete: {mb:.1f} MB (0.0 MB direct), {status.num_buckets} bucket(s), "
        f"planned {status.plan_s:.3f} s, staged {status.staged_s:.3f} s, done "
    )
    assert message.endswith(" s, applied by 1/1 receiver(s)")
    assert (done.version, done.state, done.total_bytes, done.buckets) == (
        1,
        "complete",
        status.total_bytes,
        status.num_buckets,
    )
    assert (done.applied, done.receivers, done.failed) == (1, 1, {})
    assert 0 < done.plan_s < done.staged_s <= done.done_s


def test_an_abandoned_version_gets_its_line_too(sender, caplog):
    """The publisher leaves before packing: the version is abandoned, with one line."""
    caplog.set_level(logging.INFO, logger="weightsync.sender")
    channel, stub = connect(sender.address, 10)
    requests: queue.Queue = queue.Queue()
    hello = pb.PublisherHello(publisher_id="quitter", device="cpu")
    manifest = pb.Manifest(version=1, tensors=[pb.TensorSpec(name="w", dtype="float32", shape=[4])])
    requests.put(pb.PublisherMessage(hello=hello))
    requests.put(pb.PublisherMessage(begin=pb.BeginVersion(manifest=manifest)))
    replies = stub.Publish(iter(requests.get, None), timeout=15)
    assert [next(replies).WhichOneof("kind") for _ in range(2)] == ["welcome", "pack"]
    replies.cancel()
    channel.close()
    wait_until(lambda: _records(caplog, "version_finished"), 10, "the version's log line")
    (done,) = _records(caplog, "version_finished")
    assert done.getMessage().startswith("version 1 failed: 0.0 MB (0.0 MB direct), 1 bucket(s)")
    assert done.getMessage().endswith(
        "applied by 0/0 receiver(s); abandoned: publisher rank 0 closed its stream"
    )
    assert (done.state, done.abandoned) == ("failed", "publisher rank 0 closed its stream")
    assert sender.coordinator.status().versions[-1].state == "failed"
