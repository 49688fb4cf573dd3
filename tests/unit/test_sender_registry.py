"""The sender's registry, outcomes and versions: each receiver's state through a version,
without sockets."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.support.sender_parts import SETTINGS, published, sender_parts
from weightsync.errors import ConfigError, SyncTimeoutError, VersionError
from weightsync.metrics import SenderMetrics
from weightsync.sender.history import VersionHistory
from weightsync.sender.registry import Registry
from weightsync.sender.reports import log_line
from weightsync.sender.slots import ReadEvent, SlotPool
from weightsync.sender.states import VersionState
from weightsync.transports import get_transport
from weightsync.v1 import weightsync_pb2 as pb


@pytest.fixture
def parts():
    return sender_parts()


def hello(rid: str, host: str = "here") -> pb.ReceiverHello:
    return pb.ReceiverHello(receiver_id=rid, engine="torch", device="cpu", host_id=host)


def drained(conn) -> list[str]:
    """The kinds of announcement queued for ``conn``."""
    out = []
    while not conn.outbox.empty():
        out.append(conn.outbox.get_nowait().WhichOneof("kind"))
    return out


def test_a_receiver_id_is_unique_while_connected_and_a_remote_host_is_noticed(parts):
    local = parts.registry.add_receiver(hello("a"))
    with pytest.raises(ConfigError, match="already connected"):
        parts.registry.add_receiver(hello("a"))
    assert not local.remote and parts.registry.add_receiver(hello("b", host="elsewhere")).remote
    parts.outcomes.receiver_left(local, "disconnected")
    assert parts.registry.add_receiver(hello("a")).connected  # may register again once gone


def test_a_version_not_greater_than_the_last_is_refused(parts):
    published(parts, 2)
    for version in (1, 2):
        with pytest.raises(VersionError, match="not greater than the last published version 2"):
            parts.history.check_version(version)
    parts.history.check_version(3)
    assert parts.history.last_version == 2


def test_a_receiver_that_stays_silent_fails_alone(parts):
    talker, silent = (parts.registry.add_receiver(hello(rid)) for rid in ("talker", "silent"))
    run = published(parts, 1)
    assert drained(talker) == drained(silent) == ["start"]
    verdict = pb.ManifestVerdict(version=1, accepted=True)
    parts.outcomes.on_receiver_message(talker, pb.ReceiverMessage(verdict=verdict))
    with parts.cond:
        parts.outcomes.expire(time.monotonic())
        assert run.active() == ["talker", "silent"]  # within its ack timeout
        parts.outcomes.expire(time.monotonic() + SETTINGS.ack_timeout_s + 1)
    assert run.outcomes["silent"].state == "failed"
    assert "owed: verdict" in run.outcomes["silent"].error.message
    # Told to abort, then its stream ends with the timeout: a deaf receiver must not cost
    # every later version an ack timeout (one that still listens registers again).
    abort, closed, end = (silent.outbox.get_nowait() for _ in range(3))
    assert abort.WhichOneof("kind") == "abort" and end is None and silent.outbox.empty()
    assert isinstance(closed, SyncTimeoutError) and "its stream is closed" in str(closed)
    assert (silent.connected, silent.state) == (False, "disconnected")
    assert run.outcomes["talker"].state == "pending" and drained(talker) == []
    assert run.active() == ["talker"]


def test_a_rejected_manifest_keeps_the_previous_weights_and_sends_no_abort(parts):
    conn = parts.registry.add_receiver(hello("r"))
    run = published(parts, 1)
    drained(conn)
    error = pb.ErrorDetail(code="NameResolutionError", message="no parameter 'w'")
    verdict = pb.ManifestVerdict(version=1, accepted=False, error=error)
    parts.outcomes.on_receiver_message(conn, pb.ReceiverMessage(verdict=verdict))
    assert run.outcomes["r"].state == "failed" and run.outcomes["r"].error == error
    assert (conn.state, conn.dirty, conn.last_error) == ("idle", False, "no parameter 'w'")
    assert drained(conn) == []


def test_a_failed_bucket_leaves_the_receiver_dirty(parts):
    conn = parts.registry.add_receiver(hello("r"))
    run = published(parts, 1)
    ack = pb.BucketAck(version=1, index=0, ok=False, error=pb.ErrorDetail(message="bad bytes"))
    parts.outcomes.on_receiver_message(conn, pb.ReceiverMessage(ack=ack))
    assert run.outcomes["r"].state == "failed"
    assert (conn.state, conn.dirty) == ("dirty", True)


def _ended(run) -> None:
    """What sending the end leaves: each receiver verified and owes ``applied`` alone."""
    for outcome in run.outcomes.values():
        outcome.awaiting = {"applied"}


def test_receivers_that_apply_before_the_driver_stages_the_version_complete_it_once_staged(
    parts,
):
    """CI box under load: both receivers had the end and applied before the driver, between
    sending the end and staging, took the lock again. The version was taken for one every
    receiver failed ("failed", both applied)."""
    conns = [parts.registry.add_receiver(hello(rid)) for rid in ("a", "b")]
    run = published(parts, 1, wait_applied=True)
    _ended(run)
    for conn in conns:
        applied = pb.VersionApplied(version=1, ok=True)
        parts.outcomes.on_receiver_message(conn, pb.ReceiverMessage(applied=applied))
    assert not run.done and run.ranks[0].outbox.empty()
    with parts.cond:
        run.state = VersionState.READING  # what Version.run does once it sent the end
        run.reads_done()
    assert run.state == "complete"
    outbox = run.ranks[0].outbox
    replies = [outbox.get_nowait() for _ in range(outbox.qsize())]
    assert [r.WhichOneof("kind") for r in replies] == ["staged", "done"]
    assert replies[1].done.state == "complete"


def test_a_staged_version_completes_when_every_receiver_applied_and_tells_the_publisher(parts):
    conns = [parts.registry.add_receiver(hello(rid)) for rid in ("a", "b")]
    run = published(parts, 1, wait_applied=True)
    run.state = VersionState.STAGED
    _ended(run)
    for i, conn in enumerate(conns):
        assert not run.done
        applied = pb.VersionApplied(version=1, ok=True)
        parts.outcomes.on_receiver_message(conn, pb.ReceiverMessage(applied=applied))
        assert conn.applied_version == 1 and run.outcomes[conn.receiver_id].state == "applied"
        assert run.done == (i == 1)
    assert run.state == "complete"
    assert parts.history.wait_applied(1, timeout_s=0.1).state == "complete"
    done = run.ranks[0].outbox.get_nowait()
    assert done.done.version == 1 and [o.state for o in done.done.receivers] == ["applied"] * 2
    run, abandoned = parts.shared.finished[0]
    assert "applied by 2/2" in log_line(run, abandoned).message


def test_a_receiver_gone_mid_version_fails_only_its_outcome(parts):
    gone, stays = (parts.registry.add_receiver(hello(rid)) for rid in ("gone", "stays"))
    run = published(parts, 1)
    parts.outcomes.receiver_left(gone, "closed its stream")
    assert run.outcomes["gone"].state == "failed"
    assert run.outcomes["gone"].error.message == "receiver closed its stream"
    assert run.outcomes["stays"].state == "pending" and stays.connected
    assert parts.registry.status().receivers[0].state == "disconnected"


def test_an_abandoned_version_fails_its_receivers_and_tells_its_publishers(parts):
    conn = parts.registry.add_receiver(hello("r"))
    run = published(parts, 1)
    drained(conn)
    with parts.cond:
        run.abort(pb.ErrorDetail(message="publisher rank 0 closed its stream"))
    assert run.state == "failed" and run.outcomes["r"].state == "failed"
    assert drained(conn) == ["abort"]
    assert "abandoned: publisher rank 0" in str(run.ranks[0].outbox.get_nowait())


def test_packing_does_not_wait_for_the_reads_of_a_failed_receiver():
    """Both receivers acked bucket 0 (their read events are queued for the slot's next
    packing), then one failed: its event is dropped (a dead process's might never complete)."""
    slots = SlotPool(2, 1024, open_event=lambda handle, device: handle)
    parts = sender_parts(slots)
    conns = {rid: parts.registry.add_receiver(hello(rid)) for rid in ("a", "b")}
    run = published(parts, 1)
    slots.reallocate(256, torch.device("cpu"), get_transport("shm"))
    try:
        slot = slots.claim(0)
        slot.announced(1, 0, {"a", "b"})
        for rid in conns:
            run.outcomes[rid].expect("bucket:0", SETTINGS.ack_timeout_s)  # as announcing does
        for rid, conn in conns.items():
            ack = pb.BucketAck(version=1, index=0, ok=True, read_event=rid.encode())
            parts.outcomes.on_receiver_message(conn, pb.ReceiverMessage(ack=ack))
        assert [e.receiver_id for e in slot.read_events] == ["a", "b"]
        parts.outcomes.receiver_left(conns["a"], "closed its stream")
        assert slot.read_events == [ReadEvent("b", b"b")]
        assert run.outcomes["b"].state == "pending"
    finally:
        slots.close()


def test_a_forgotten_receiver_leaves_the_metrics_endpoint_too():
    """Engines restarted under new ids must not grow /metrics forever: the series of a
    receiver Status forgot (here: past a cap of 0 disconnected receivers) go with it; a
    connected receiver's stay."""
    cond = threading.Condition()
    metrics = SenderMetrics()
    settings = SETTINGS.model_copy(update={"max_disconnected_receivers": 0})
    registry = Registry(cond, settings, metrics, VersionHistory(cond, settings.history), "here")
    with cond:
        gone, staying = registry.add_receiver(hello("gone")), registry.add_receiver(hello("stays"))
        for conn in (gone, staying):
            metrics.receiver_applied(conn.receiver_id, 3)
            metrics.receiver_failed(conn.receiver_id)
        registry.disconnect(gone)

    def series(name: str) -> set[str]:
        return {
            sample.labels["receiver"]
            for metric in metrics.registry.collect()
            if metric.name == name
            for sample in metric.samples
            if "receiver" in sample.labels
        }

    assert series("weightsync_receiver_applied_version") == {"gone", "stays"}
    registry.status()  # prunes
    assert series("weightsync_receiver_applied_version") == {"stays"}
    assert series("weightsync_receiver_failures") == {"stays"}


def test_announcements_sent_together_reach_a_batching_receiver_as_one_message(parts):
    from weightsync.sender.service import take_queued

    batching = parts.registry.add_receiver(pb.ReceiverHello(receiver_id="new", batches=True))
    single = parts.registry.add_receiver(hello("old"))
    start, end = pb.Announcement(start=pb.VersionStart()), pb.Announcement(end=pb.VersionEnd())
    with parts.cond, parts.registry.together():
        for conn in (batching, single):
            conn.send(start)
            conn.send(end)
        assert batching.outbox.empty()  # held until the block ends
    # Taken whole even where a take is capped at one; a receiver that takes no batches gets
    # them one by one.
    assert take_queued(batching.outbox, 1)[0] == [start, end]
    assert [take_queued(single.outbox, 1)[0] for _ in range(2)] == [[start], [end]]
