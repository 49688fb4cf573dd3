"""Same-host lanes over real Unix sockets: a lane carries framed messages in order, is taken
once by the token of the stream it was offered to, and a client that cannot take one stays on
gRPC."""

import queue
import threading

import pytest

from weightsync.control.lanes import LaneServer, connect_lane, switched
from weightsync.errors import ProtocolError
from weightsync.v1 import weightsync_pb2 as pb


@pytest.fixture
def lane_pair():
    """A client's lane and the sender's end of it, taken through a real LaneServer."""
    server = LaneServer()
    taken: queue.Queue = queue.Queue()
    try:
        client = connect_lane(server.offer(taken.put, lambda: None))
        assert client is not None
        yield client, taken.get(timeout=5)
    finally:
        server.close()


def acked(index: int) -> pb.ReceiverMessage:
    return pb.ReceiverMessage(ack=pb.BucketAck(version=7, index=index, ok=True))


def test_a_lane_carries_messages_in_order_both_ways_and_ends_with_its_writer(lane_pair):
    client, sender_end = lane_pair
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(sender_end.messages(pb.ReceiverMessage)))
    reader.start()  # as the sender's consumer thread reads: a full socket blocks writers
    for i in range(300):
        client.send(acked(i))
    client.close_write()
    reader.join(10)
    assert [m.ack.index for m in got] == list(range(300))
    big = pb.Announcement(start=pb.VersionStart(manifest_key=b"k" * (4 << 20)))

    def send_and_close() -> None:  # 4 MiB does not fit the socket's buffer: read alongside
        sender_end.send(big)
        sender_end.close()

    writer = threading.Thread(target=send_and_close)
    writer.start()
    assert list(client.messages(pb.Announcement)) == [big]
    writer.join()


def test_a_token_takes_its_lane_once_and_no_other_token_takes_one():
    server = LaneServer()
    taken: list = []
    try:
        offer = server.offer(taken.append, lambda: None)
        assert connect_lane(pb.LaneOffer(path=offer.path, token=b"x" * 16)) is None
        first = connect_lane(offer)
        assert first is not None and len(taken) == 1
        assert connect_lane(offer) is None  # a second client with the same token
        withdrawn = server.offer(taken.append, lambda: None)
        server.withdraw(withdrawn)  # its stream ended before its client came
        assert connect_lane(withdrawn) is None
        assert len(taken) == 1
    finally:
        server.close()


def test_a_lane_out_of_reach_leaves_the_stream_on_grpc(tmp_path):
    assert connect_lane(pb.LaneOffer(path=str(tmp_path / "gone"), token=b"t")) is None
    server = LaneServer()
    offer = server.offer(lambda lane: None, lambda: None)
    server.close()  # the sender closed between its offer and the client's connect
    assert connect_lane(offer) is None


def test_switched_reads_grpc_up_to_the_switch_then_the_lane_and_raises_how_grpc_ended(lane_pair):
    """The gRPC side as an iterator the way gRPC hands it over: messages, then an error."""
    client, sender_end = lane_pair
    grpc_side: queue.Queue = queue.Queue()

    def grpc_messages():
        while (item := grpc_side.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item

    for message in (acked(0), acked(1), pb.ReceiverMessage(lane=pb.LaneSwitch())):
        grpc_side.put(message)
    client.send(acked(2))
    client.send(acked(3))
    read = switched(grpc_messages(), lambda: sender_end, pb.ReceiverMessage)
    assert [next(read).ack.index for _ in range(4)] == [0, 1, 2, 3]
    # The gRPC stream breaks (the peer's keepalive failed): the lane closes, and the reader
    # raises what gRPC said.
    grpc_side.put(ConnectionError("ping timeout"))
    with pytest.raises(ConnectionError, match="^ping timeout$"):
        next(read)


def test_a_switch_to_a_lane_never_taken_is_a_protocol_error():
    read = switched(iter([pb.ReceiverMessage(lane=pb.LaneSwitch())]), lambda: None, None)
    with pytest.raises(ProtocolError, match="to a lane it never took"):
        next(read)


def test_writers_on_many_threads_never_interleave_frames(lane_pair):
    client, sender_end = lane_pair
    payload = {
        t: pb.Announcement(start=pb.VersionStart(manifest_key=bytes([t]) * 70_000))
        for t in range(4)
    }
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(sender_end.messages(pb.Announcement)))
    reader.start()

    def write(t: int) -> None:
        for _ in range(50):
            client.send(payload[t])

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    client.close_write()
    reader.join(10)
    assert len(got) == 200 and all(m in payload.values() for m in got)


def test_the_senders_first_frame_never_reaches_the_client_before_the_taken_byte():
    """The sender switches (and may write at once) only after the byte that tells the client
    its lane was taken; a frame before it read as that byte left the client on gRPC while the
    sender had switched (test_pipelining.py caught it in a local run)."""
    server = LaneServer()
    attached: list = []
    first = pb.SenderReply(staged=pb.VersionStaged(version=3, receivers=1))
    try:
        for _ in range(50):
            client = connect_lane(server.offer(attached.append, lambda: attached[-1].send(first)))
            assert client is not None
            assert next(client.messages(pb.SenderReply)) == first
            client.close()
    finally:
        server.close()
