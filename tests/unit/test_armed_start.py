"""The armed start (``sender/armed.py``) with the sender's real bookkeeping and driver, on CPU:
a direct version that repeats the last one's plan goes to its receivers before it is planned,
each message once; anything that could change the plan keeps it from going ahead; a plan
that differs after all, or fails, aborts it at the receivers."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.support.sender_parts import (
    DIRECT_SPECS,
    SETTINGS,
    SenderParts,
    direct_run,
    sender_parts,
)
from tests.support.waiting import wait_until
from weightsync.errors import WeightSyncError
from weightsync.sender.armed import ArmedStarts
from weightsync.sender.catch_ups import CatchUps
from weightsync.sender.direct_reads import DirectRead
from weightsync.sender.driver import VersionDriver
from weightsync.sender.outcomes import Outcomes
from weightsync.sender.records import ReceiverConn, announced_version
from weightsync.sender.version import Version
from weightsync.transports.broadcast import SenderBroadcast
from weightsync.v1 import weightsync_pb2 as pb

KEY = b"manifest-key"


def _direct_run(parts: SenderParts, version: int, layout_key: bytes = b"read-0") -> Version:
    """A direct version receiver r0 reads by its own direct bucket (keyed ``layout_key``)."""
    run = direct_run(parts, version, manifest_key=KEY)
    layout = run.tensors.layouts[run.tensors.direct.index]
    read = DirectRead(layout, run.tensors.direct_sources, {"local": 2048}, key=layout_key)
    run.direct_reads = {"r0": read}
    return run


class Sender:
    """The parts, a driver, one receiver (r0) that takes batches and keeps keys."""

    def __init__(self) -> None:
        self.parts = sender_parts()
        self.conn = self.register("r0")
        broadcast = SenderBroadcast(
            "127.0.0.1",
            5,
            self.parts.cond,
            self.parts.registry.broadcast_members,
            self.parts.registry.receiver,
        )
        self.driver = VersionDriver(self.parts.shared, broadcast)
        self.armed = ArmedStarts(self.parts.shared, self.parts.history, _NoCatchUps())

    def register(self, rid: str) -> ReceiverConn:
        hello = pb.ReceiverHello(
            receiver_id=rid,
            engine="torch",
            device="cpu",
            host_id="here",
            batches=True,
            layout_keys=True,
            manifest_keys=True,
        )
        return self.parts.registry.add_receiver(hello)

    def ahead(self, run: Version) -> list[ReceiverConn]:
        """What the coordinator does with a joined version: present it, plan it (here: it
        was planned already), record it."""
        with self.parts.cond, self.armed.ahead(run.ranks, "p", KEY, run.version) as conns:
            self.parts.history.check_version(run.version)
            self.parts.history.add_run(run)
        return conns

    def start(self, run: Version) -> None:
        """Its start, then the driver sends the rest (nothing) and waits for the reads."""
        self.driver.start(run, torch.device("cpu"))
        wait_until(lambda: run.state != "packing", 10, f"version {run.version} to be sent")

    def reply(self, run: Version, conn: ReceiverConn | None = None) -> None:
        conn = conn or self.conn
        v, index = run.version, run.tensors.direct.index
        for msg in (
            pb.ReceiverMessage(verdict=pb.ManifestVerdict(version=v, accepted=True)),
            pb.ReceiverMessage(ack=pb.BucketAck(version=v, index=index, ok=True)),
            pb.ReceiverMessage(applied=pb.VersionApplied(version=v, ok=True)),
        ):
            self.parts.outcomes.on_receiver_message(conn, msg)

    def close(self) -> None:
        self.driver.close()
        if self.driver._thread is not None:
            self.driver._thread.join(10)
        self.parts.shared.slots.close()


class _NoCatchUps:
    def runs(self) -> list[Version]:
        return []


def _sent(conn: ReceiverConn) -> list[pb.Announcement]:
    """Every announcement queued for ``conn``, batches opened."""
    out = []
    while not conn.outbox.empty():
        msg = conn.outbox.get_nowait()
        items = msg if isinstance(msg, list) else [msg]
        for item in items:
            out += list(item.batch.items) if item.WhichOneof("kind") == "batch" else [item]
    return out


def _kinds(messages: list[pb.Announcement]) -> list[tuple[str, int]]:
    return [(m.WhichOneof("kind"), announced_version(m)) for m in messages]


@pytest.fixture
def sender():
    s = Sender()
    yield s
    s.close()


def _two_applied(sender: Sender) -> Version:
    """Versions 1 and 2, planned and announced as usual, applied. The receiver declares its
    boxes with its first verdict, so version 1 was planned without them and version 2 with
    them: only version 3 can repeat version 2's plan."""
    for v in (1, 2):
        run = _direct_run(sender.parts, v)
        assert sender.ahead(run) == []
        sender.start(run)
        sender.reply(run)
        wait_until(lambda run=run: run.state == "complete", 10, f"version {v} to complete")
    _sent(sender.conn)
    return run


def test_a_repeated_direct_version_goes_ahead_of_its_plan_once(sender):
    """Version 3 repeats version 2: its start, bucket and end reach the receiver in one batch
    before it is planned; its own start sends nothing again; it completes as any other."""
    _two_applied(sender)
    second = _direct_run(sender.parts, 3)
    assert sender.ahead(second) == [sender.conn]
    sent = sender.conn.outbox.get_nowait()
    assert isinstance(sent, list) and _kinds(sent) == [("start", 3), ("bucket", 3), ("end", 3)]
    # The forms by key: the manifest and the layout went with version 1.
    assert not sent[0].start.manifest.tensors and sent[1].bucket.layout_key == b"read-0"
    sender.start(second)
    assert _sent(sender.conn) == []
    assert not sender.conn.presented
    sender.reply(second)
    assert second.state == "complete"
    replies = [second.ranks[0].outbox.get_nowait() for _ in range(second.ranks[0].outbox.qsize())]
    assert [r.WhichOneof("kind") for r in replies] == ["staged", "done"]
    assert sender.parts.shared.metrics.presented._value.get() == 1


def test_a_reply_before_the_version_expects_it_waits_for_its_start(sender):
    """The receiver's verdict can arrive before the version's start addressed it (it copies
    while the sender plans): it waits, and counts once the start ran."""
    _two_applied(sender)
    second = _direct_run(sender.parts, 3)
    sender.ahead(second)
    verdict = pb.ReceiverMessage(verdict=pb.ManifestVerdict(version=3, accepted=True))
    early = threading.Thread(
        target=sender.parts.outcomes.on_receiver_message, args=(sender.conn, verdict)
    )
    early.start()
    early.join(0.3)
    assert early.is_alive(), "the verdict was taken before the version expected it"
    sender.start(second)
    early.join(10)
    assert not early.is_alive()
    assert "verdict" not in second.outcomes["r0"].awaiting


def _new_receiver(sender: Sender) -> None:
    sender.register("r1")


def _new_boxes(sender: Sender) -> None:
    sender.conn.declare({}, list(DIRECT_SPECS))  # for another tensor list: replaced


def _in_flight(sender: Sender) -> None:
    sender.parts.history.add_run(_direct_run(sender.parts, 5))


@pytest.mark.parametrize(
    "change",
    [_new_receiver, _new_boxes, _in_flight],
    ids=["a receiver joined", "boxes declared again", "a version still running"],
)
def test_what_could_change_the_plan_keeps_a_version_from_going_ahead(sender, change):
    _two_applied(sender)
    with sender.parts.cond:
        change(sender)
    assert sender.ahead(_direct_run(sender.parts, 6)) == []
    assert _sent(sender.conn) == []


def test_a_failed_version_is_not_repeated(sender):
    """A version that went ahead and failed at the receiver: the next is planned first."""
    _two_applied(sender)
    third = _direct_run(sender.parts, 3)
    assert sender.ahead(third) == [sender.conn]
    sender.start(third)
    failed = pb.VersionApplied(version=3, ok=False, error=pb.ErrorDetail(message="engine died"))
    for msg in (
        pb.ReceiverMessage(verdict=pb.ManifestVerdict(version=3, accepted=True)),
        pb.ReceiverMessage(ack=pb.BucketAck(version=3, index=third.tensors.direct.index, ok=True)),
        pb.ReceiverMessage(applied=failed),
    ):
        sender.parts.outcomes.on_receiver_message(sender.conn, msg)
    assert third.state == "failed"
    assert sender.ahead(_direct_run(sender.parts, 4)) == []


def test_a_plan_that_differs_from_what_went_ahead_abandons_the_version(sender):
    """Were the plan to differ after all (a bug), the version is abandoned: the receiver is
    told to abort it, its publisher hears why, and the next version is planned first."""
    _two_applied(sender)
    second = _direct_run(sender.parts, 3, layout_key=b"another-read")
    sender.ahead(second)
    _sent(sender.conn)
    sender.start(second)
    assert second.state == "failed"
    assert _kinds(_sent(sender.conn)) == [("abort", 3)]
    assert not sender.conn.presented
    error = second.ranks[0].outbox.get_nowait()
    assert isinstance(error, WeightSyncError)
    assert "differs from the bucket sent ahead of its plan (armed start)" in str(error)
    assert sender.ahead(_direct_run(sender.parts, 4)) == []


def test_a_plan_that_fails_after_going_ahead_aborts_it_at_the_receivers(sender):
    _two_applied(sender)
    second = _direct_run(sender.parts, 3)
    with (
        pytest.raises(RuntimeError, match="planner broke"),
        sender.parts.cond,
        sender.armed.ahead(second.ranks, "p", KEY, 3) as conns,
    ):
        assert conns == [sender.conn]
        raise RuntimeError("planner broke")
    sent = _sent(sender.conn)
    assert _kinds(sent) == [("start", 3), ("bucket", 3), ("end", 3), ("abort", 3)]
    assert "planner broke" in sent[-1].abort.reason.message
    assert not sender.conn.presented


def test_switched_off_every_version_is_planned_first(sender):
    """``armed_starts=False`` (``--no-armed-starts``): nothing goes ahead of its plan."""
    _two_applied(sender)
    settings = SETTINGS.model_copy(update={"armed_starts": False})
    off = ArmedStarts(
        sender.parts.shared._replace(settings=settings), sender.parts.history, _NoCatchUps()
    )
    third = _direct_run(sender.parts, 3)
    with sender.parts.cond, off.ahead(third.ranks, "p", KEY, 3) as conns:
        assert conns == []
    assert _sent(sender.conn) == []


def test_a_reply_whose_version_never_starts_is_dropped_at_the_ack_timeout(sender, caplog):
    """Bounded: were the start never to come (a bug), the reply waits ``ack_timeout_s``, is
    dropped with a warning, and the receiver's stream goes on."""
    _two_applied(sender)
    sender.ahead(_direct_run(sender.parts, 3))
    quick = sender.parts.shared._replace(
        settings=SETTINGS.model_copy(update={"ack_timeout_s": 0.2})
    )
    outcomes = Outcomes(quick, sender.parts.history, CatchUps(quick, sender.parts.history))
    verdict = pb.ReceiverMessage(verdict=pb.ManifestVerdict(version=3, accepted=True))
    outcomes.on_receiver_message(sender.conn, verdict)
    assert "its verdict of version 3 came before the version's start" in caplog.text


def test_messages_of_other_versions_and_kinds_pass_a_version_sent_ahead(sender):
    """While version 3 waits for its start, another version's or kind's message goes as
    usual and leaves what went ahead alone; an abort of version 3 drops it."""
    _two_applied(sender)
    sender.ahead(_direct_run(sender.parts, 3))
    _sent(sender.conn)
    other = pb.Announcement(start=pb.VersionStart(manifest=pb.Manifest(version=9)))
    export = pb.Announcement(export=pb.PackBucket(version=2))
    with sender.parts.cond:
        sender.conn.send(other)
        sender.conn.send(export)
        assert [m.WhichOneof("kind") for m in _sent(sender.conn)] == ["start", "export"]
        assert len(sender.conn.presented) == 3
        sender.conn.send(pb.Announcement(abort=pb.VersionAbort(version=3)))
    assert not sender.conn.presented
