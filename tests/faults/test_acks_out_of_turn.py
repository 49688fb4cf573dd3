"""Issue 35 item 7b: a receiver that acks buckets it never got was reported applied.
(And the one way to ack late that is in turn: the last acks inside ``applied``.)

The sender took any ack and any ``applied`` of a receiver still in a version. Now it refuses,
ending that receiver's stream ``FAILED_PRECONDITION`` (``ProtocolError``; the version fails for
it alone): an ack of a bucket not announced to it, a second ack of one bucket, an ``applied``
before the version's end or before every bucket announced to it was acked.
"""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from tests.support import sync_in_thread
from tests.support.raw_streams import raw_receiver
from weightsync.errors import ReceiverFailedError
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher
from weightsync.v1 import weightsync_pb2 as pb

N = 1024
"""float32 elements of ``w0`` and ``w1``: one 4 KiB bucket each (the fixture's cap)."""


class Three(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w0 = torch.nn.Parameter(torch.zeros(N))
        self.w1 = torch.nn.Parameter(torch.zeros(N))
        self.w2 = torch.nn.Parameter(torch.zeros(N))


def _ack(index: int) -> pb.ReceiverMessage:
    return pb.ReceiverMessage(ack=pb.BucketAck(version=1, index=index, ok=True))


APPLIED = pb.ReceiverMessage(applied=pb.VersionApplied(version=1, ok=True))

CASES = {
    # what the raw receiver sends once it saw the kind named: ...
    "an ack of a bucket never announced": (
        "start",
        [_ack(7)],
        "ProtocolError: receiver raw acked bucket 7 of version 1, which was not announced to "
        "it or which it acked already; ack each bucket announced to you once",
    ),
    "a second ack of one bucket": (
        "bucket",
        [_ack(0), _ack(0)],
        "ProtocolError: receiver raw acked bucket 0 of version 1, which was not announced to "
        "it or which it acked already; ack each bucket announced to you once",
    ),
    "applied before the end": (
        "start",
        [APPLIED],
        "ProtocolError: receiver raw sent applied for version 1 before the version's end; "
        "send applied after the end",
    ),
    "applied before its acks": (
        "end",
        [_ack(1), APPLIED],
        "ProtocolError: receiver raw sent applied for version 1 before its ack of bucket 0; "
        "ack every bucket announced to you first",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_reply_out_of_turn_ends_the_receivers_stream_and_fails_it_alone(sender, case):
    when, messages, details = CASES[case]
    model = Three()
    good = TorchReceiver(model, sender.address, receiver_id="good")
    syncs, _ = sync_in_thread(good)
    raw = raw_receiver(sender.address)
    assert raw.first() == "welcome"
    tensors = {"w0": torch.ones(N), "w1": torch.full((N,), 2.0)}
    if case == "applied before the end":
        # A third bucket needs a staging slot back from every reader (two slots), so the end
        # cannot be announced before the raw receiver's applied (else that applied would be
        # before its acks, on a loaded machine).
        tensors["w2"] = torch.full((N,), 3.0)
    published: list = []

    def publish() -> None:
        try:
            Publisher(sender.address).publish(tensors, 1, wait=True, timeout_s=60)
        except ReceiverFailedError as e:
            published.append(e)

    thread = threading.Thread(target=publish)
    thread.start()
    sent = False

    def answer(reply: pb.Announcement) -> None:
        nonlocal sent
        kind = reply.WhichOneof("kind")
        if kind == "start":
            raw.send(pb.ReceiverMessage(verdict=pb.ManifestVerdict(version=1, accepted=True)))
        if kind == when and not sent:
            sent = True
            for message in messages:
                raw.send(message)

    kinds, code, got = raw.outcome(answer)
    raw.close()
    thread.join()
    assert (code, got) == (grpc.StatusCode.FAILED_PRECONDITION, details)
    # The version fails for the raw receiver alone: the good one applied it.
    assert syncs.finish(30) == [1]
    assert torch.equal(model.w1.detach(), tensors["w1"])
    (error,) = published
    why = details.removeprefix("ProtocolError: ")
    assert (
        str(error)
        == f"version 1 failed on 1 receiver(s): raw: ProtocolError: receiver refused: {why}"
    )


def test_the_last_ack_may_come_inside_applied(sender):
    """A sender's welcome says ``acks_in_applied``; a receiver that holds its last ack until
    the end and sends it inside its applied (one message) has the version applied."""
    raw = raw_receiver(sender.address)
    welcome = next(raw.replies)
    assert welcome.WhichOneof("kind") == "welcome" and welcome.welcome.acks_in_applied
    tensors = {"w0": torch.ones(N), "w1": torch.full((N,), 2.0)}
    held: list[pb.BucketAck] = []

    def answer(reply: pb.Announcement) -> None:
        kind = reply.WhichOneof("kind")
        if kind == "start":
            raw.send(pb.ReceiverMessage(verdict=pb.ManifestVerdict(version=1, accepted=True)))
        elif kind == "bucket" and reply.bucket.layout.is_last:
            held.append(pb.BucketAck(version=1, index=reply.bucket.layout.index, ok=True))
        elif kind == "bucket":
            raw.send(_ack(reply.bucket.layout.index))
        elif kind == "end":
            raw.send(pb.ReceiverMessage(applied=pb.VersionApplied(version=1, ok=True, acks=held)))

    reading = threading.Thread(target=raw.outcome, args=(answer,))
    reading.start()
    try:
        result = Publisher(sender.address).publish(tensors, 1, wait=True, timeout_s=30)
    finally:
        raw.close()
        reading.join()
    (outcome,) = result.status.receivers
    assert (outcome.receiver_id, outcome.state) == ("raw", "applied")
    assert [a.index for a in held] == [1]
