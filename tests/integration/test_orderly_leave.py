"""Issue 35: a receiver that reports a version applied and leaves at once is applied
in that version, whether it leaves in order (ends its stream and reads it to its end, as
weightsync's receivers do) or cancels the call right after ``applied`` (docs/protocol.md §4).
Before, the call's end failed the receiver at once, while the sender still handled the
``applied`` it had taken off the stream: the version failed as "receiver disconnected"."""

from __future__ import annotations

import threading
import time

import pytest

from tests.support import TinyNet
from weightsync.receiver import TorchReceiver
from weightsync.receiver.connection import GrpcConnection
from weightsync.sender import Publisher
from weightsync.sender.coordinator import Coordinator


def _cancel_at_once(self, flush_timeout_s: float) -> None:
    """Leave as a client that cancels its call right after sending its last message."""
    self._closed.set()
    self._stream.end()
    time.sleep(0.05)  # gRPC writes the queued ``applied``
    self._stream.cancel()
    self._channel.close()


@pytest.mark.parametrize("lanes", [False, True], ids=["grpc", "lane"])
@pytest.mark.parametrize("leave", ["in_order", "cancel"])
@pytest.mark.parametrize("slow", ["applied", "ack"], ids=["slow_applied", "slow_ack"])
def test_a_receiver_that_leaves_right_after_applied_stays_applied(
    sender, monkeypatch, lanes, leave, slow
):
    """The sender is slow to handle the receiver's ``applied`` (the call ends while it does),
    or its last ``ack``: then ``applied`` had not been taken off the stream yet. Before, a
    cancelled gRPC call dropped it (gRPC takes a message off the stream only when asked for the
    next one), and the end of the gRPC stream closed the lane with it unread (after an orderly
    leave too)."""
    monkeypatch.setenv("WEIGHTSYNC_LANES", "1" if lanes else "0")
    handle = Coordinator.on_receiver_message

    def slowly(self, conn, msg):
        if msg.WhichOneof("kind") == slow:
            time.sleep(0.3)
        return handle(self, conn, msg)

    monkeypatch.setattr(Coordinator, "on_receiver_message", slowly)
    if leave == "cancel":
        monkeypatch.setattr(GrpcConnection, "close", _cancel_at_once)
    trainer = TinyNet(seed=1)
    publisher = Publisher(sender.address)
    for version in (1, 2):
        rid = f"leaver-{version}"
        receiver = TorchReceiver(TinyNet(seed=2), sender.address, receiver_id=rid)
        got: list[int] = []

        def sync_and_leave(receiver=receiver, got=got):
            got.append(receiver.sync(timeout=30))
            receiver.close()

        t = threading.Thread(target=sync_and_leave)
        t.start()
        result = publisher.publish(trainer.state_dict(), version, wait=True, timeout_s=60)
        t.join(30)
        assert got == [version]
        outcomes = {o.receiver_id: (o.state, o.error.message) for o in result.status.receivers}
        assert outcomes == {rid: ("applied", "")}, (version, outcomes)
        assert result.status.state == "complete"
    publisher.close()
