"""A lane's frames sent before its gRPC stream ended are still read (issue 35).

The end of a stream's gRPC call used to close its lane at once: a message the peer had written
to the lane but the reader had not read yet (the sender was still handling the one before) was
lost, after an orderly leave too (the receiver's ``applied``, which then failed the version as
"receiver closed its stream"). Now the end stops the lane's reading after what was sent: the
reader gets those frames, then the gRPC stream's error; the peer can write nothing more."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from tests.support.waiting import wait_until
from weightsync.control.lanes import Lane, switched
from weightsync.v1 import weightsync_pb2 as pb


class _LateReader(Lane):
    """Reads only once the gRPC stream's end has ended the lane (the reader was busy)."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.ended = threading.Event()

    def close_read(self) -> None:
        self.ended.set()
        super().close_read()

    def close(self) -> None:
        self.ended.set()
        super().close()

    def messages(self, cls):
        assert self.ended.wait(10)
        yield from super().messages(cls)


def _frame(msg) -> bytes:
    data = msg.SerializeToString()
    return struct.pack("<I", len(data)) + data


def test_frames_sent_before_the_grpc_stream_ended_are_read():
    ours, peers = socket.socketpair()
    lane = _LateReader(ours)
    sent = [
        pb.ReceiverMessage(ack=pb.BucketAck(version=3, index=0, ok=True)),
        pb.ReceiverMessage(ack=pb.BucketAck(version=3, index=1, ok=True)),
        pb.ReceiverMessage(applied=pb.VersionApplied(version=3, ok=True)),
    ]
    for msg in sent:
        peers.sendall(_frame(msg))

    def grpc_stream():
        yield pb.ReceiverMessage(lane=pb.LaneSwitch())
        raise RuntimeError("the call was cancelled")  # the peer cancelled after its applied

    got = []
    with pytest.raises(RuntimeError, match="the call was cancelled"):
        for msg in switched(grpc_stream(), lambda: lane, pb.ReceiverMessage):
            got.append(msg)
    assert got == sent
    with pytest.raises(BrokenPipeError):  # nothing more is read from the peer
        peers.sendall(_frame(sent[0]))
    wait_until(lambda: ours.fileno() == -1, 10, "the lane to be closed once read")
    peers.close()
