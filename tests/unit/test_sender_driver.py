"""The version driver with the sender's real bookkeeping, on CPU: a version whose tensors
are all read in place ends with one ``staged`` and one ``done`` to its publisher, staged where
its last read ends."""

from __future__ import annotations

import time

import pytest
import torch

from tests.support.sender_parts import direct_run, sender_parts
from weightsync.errors import ProtocolError
from weightsync.sender.driver import VersionDriver
from weightsync.transports.broadcast import SenderBroadcast
from weightsync.v1 import weightsync_pb2 as pb


def _until(check, what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


_VERDICT = pb.ReceiverMessage(verdict=pb.ManifestVerdict(version=1, accepted=True))
_ACK = pb.ReceiverMessage(ack=pb.BucketAck(version=1, index=0, ok=True))
_APPLIED = pb.ReceiverMessage(applied=pb.VersionApplied(version=1, ok=True))
_FAILED = pb.ReceiverMessage(
    applied=pb.VersionApplied(version=1, ok=False, error=pb.ErrorDetail(message="engine died"))
)


@pytest.mark.parametrize(
    ("messages", "state"),
    [
        ((_VERDICT, _ACK, _APPLIED), "complete"),
        ((_VERDICT, _APPLIED), "failed"),
        ((_VERDICT, _FAILED), "failed"),
    ],
    ids=["read and applied", "applied without its ack (refused)", "failed while reading"],
)
def test_a_direct_version_is_staged_once_its_reader_is_done_and_done_once(messages, state):
    """The driver does not wait for the direct reads: the receiver's last ack (or its
    failure) stages the version, and the publisher hears ``staged`` and ``done`` once each."""
    parts = sender_parts()
    hello = pb.ReceiverHello(receiver_id="r0", engine="torch", device="cpu", host_id="here")
    conn = parts.registry.add_receiver(hello)
    broadcast = SenderBroadcast(
        "127.0.0.1", 5, parts.cond, parts.registry.broadcast_members, parts.registry.receiver
    )
    driver = VersionDriver(parts.shared, broadcast)
    run = direct_run(parts, 1)
    assert run.tensors.direct.index == 0
    with parts.cond:
        parts.history.check_version(1)
        parts.history.add_run(run)
    driver.start(run, torch.device("cpu"))
    _until(lambda: run.state == "reading", "the driver to send everything")
    assert run.direct_readers == {"r0"}
    for msg in messages:
        if msg is _APPLIED and _ACK not in messages:
            # Issue 35 item 7b: the servicer ends such a receiver's stream, failing it.
            with pytest.raises(ProtocolError, match="before its ack of bucket 0"):
                parts.outcomes.on_receiver_message(conn, msg)
            parts.outcomes.receiver_left(conn, "refused")
        else:
            parts.outcomes.on_receiver_message(conn, msg)
    assert run.state == state
    driver.close()
    driver._thread.join(10)
    outbox = run.ranks[0].outbox
    replies = [outbox.get_nowait() for _ in range(outbox.qsize())]
    assert [r.WhichOneof("kind") for r in replies] == ["staged", "done"]
    assert replies[1].done.state == state
    parts.shared.slots.close()
