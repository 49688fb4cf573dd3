"""The version driver with the sender's real bookkeeping, on CPU: a version whose tensors
are all read in place ends with one ``staged`` and one ``done`` to its publisher, whichever
thread sees the last read."""

from __future__ import annotations

import queue
import time

import torch

from tests.support.sender_parts import SETTINGS, sender_parts
from weightsync.buckets import TensorSpec
from weightsync.manifest import VersionManifest
from weightsync.metrics import SenderMetrics
from weightsync.sender.broadcast import SenderBroadcast
from weightsync.sender.driver import VersionDriver
from weightsync.sender.planner import plan_tensors
from weightsync.sender.records import RankConn, VersionRun
from weightsync.sender.slots import SlotPool
from weightsync.v1 import weightsync_pb2 as pb


def _direct_run(version: int) -> VersionRun:
    """Two tensors the publisher offers whole: nothing is staged."""
    manifest = VersionManifest(
        version, (TensorSpec("a", "float32", (64,)), TensorSpec("b", "float32", (64,)))
    )
    piece = dict(source=0, dtype="float32", size=[64], stride=[1], dst_start=[0])
    begin = pb.BeginVersion(
        wait_applied=True,
        allow_direct=True,
        sources=[pb.BufferHandle(buffer_id="storage", nbytes=4096)],
        pieces=[
            pb.SourcePiece(name="a", offset=0, **piece),
            pb.SourcePiece(name="b", offset=256, **piece),
        ],
    )
    tensors = plan_tensors(manifest, {0: begin}, True, SETTINGS.bucket_size_bytes)
    assert tensors.direct is not None and not tensors.staged.buckets
    ranks = {0: RankConn(0, "cpu", begin, outbox=queue.Queue())}
    return VersionRun(manifest, tensors, "p", "shm", ranks, notify_done=True)


def _until(check, what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_a_direct_version_is_staged_and_done_once_when_its_last_read_ends_the_drivers_wait():
    parts = sender_parts()
    hello = pb.ReceiverHello(receiver_id="r0", engine="torch", device="cpu", host_id="here")
    conn = parts.registry.add_receiver(hello)
    slots = SlotPool(2, SETTINGS.bucket_size_bytes)
    broadcast = SenderBroadcast("127.0.0.1", 5, parts.cond, parts.registry, parts.outcomes)
    driver = VersionDriver(parts.cond, SETTINGS, SenderMetrics(), parts.outcomes, slots, broadcast)
    run = _direct_run(1)
    with parts.cond:
        parts.history.check_version(1)
        parts.history.add_run(run)
    driver.start(run, torch.device("cpu"))
    # The driver sent everything and waits for the receiver to finish reading in place.
    _until(lambda: run.state == "reading", "the driver to wait for the direct reads")
    assert run.direct_readers == {"r0"}
    messages = (
        pb.ReceiverMessage(ack=pb.BucketAck(version=1, index=run.tensors.direct.index, ok=True)),
        pb.ReceiverMessage(applied=pb.VersionApplied(version=1, ok=True)),
    )
    for msg in messages:
        parts.outcomes.on_receiver_message(conn, msg)
    assert run.state == "complete"
    driver.close()
    driver._thread.join(10)
    outbox = run.ranks[0].outbox
    replies = [outbox.get_nowait() for _ in range(outbox.qsize())]
    assert [r.WhichOneof("kind") for r in replies] == ["staged", "done"]
    slots.close()
