"""A packed bucket's announcement in each receiver's form (``packed_bucket``)."""

from types import SimpleNamespace

from weightsync.sender.announcements import packed_bucket
from weightsync.sender.planner import BROADCAST, MAP
from weightsync.v1 import weightsync_pb2 as pb

LAYOUT = pb.BucketLayout(
    index=3, nbytes=512, entries=[pb.BucketEntry(tensor=pb.TensorSpec(name="w"), nbytes=512)]
)


def _conn(rid: str, path: str) -> SimpleNamespace:
    return SimpleNamespace(receiver_id=rid, data_path=path)


def test_each_receiver_gets_its_form_each_form_built_once():
    handle = pb.BufferHandle(buffer_id="slot-1")
    slot = SimpleNamespace(buffer=SimpleNamespace(handle=handle), packed_event=(None, b"ev"))
    delta = SimpleNamespace(msg=pb.BucketDelta(nbytes=64))
    message = packed_bucket(
        SimpleNamespace(version=7), LAYOUT, slot, "g1", delta, frozenset({"w1"})
    )
    mapped, mapped_too = message(_conn("m1", MAP)), message(_conn("m2", MAP))
    written, sent = message(_conn("w1", MAP)), message(_conn("b1", BROADCAST))
    assert mapped is mapped_too  # one message for every receiver of a form
    for a in (mapped, written, sent):
        assert a.bucket.version == 7 and a.bucket.layout == LAYOUT
    assert mapped.bucket.buffer == handle and mapped.bucket.ready_event == b"ev"
    assert not mapped.bucket.written and not mapped.bucket.group_id
    assert written.bucket.written and not written.bucket.HasField("buffer")
    assert not written.bucket.ready_event and not written.bucket.group_id
    assert sent.bucket.group_id == "g1" and sent.bucket.delta.nbytes == 64
    assert not sent.bucket.HasField("buffer") and not sent.bucket.written


def test_a_slot_without_an_event_and_a_bucket_without_a_delta_leave_them_unset():
    slot = SimpleNamespace(buffer=SimpleNamespace(handle=pb.BufferHandle()), packed_event=None)
    message = packed_bucket(SimpleNamespace(version=1), LAYOUT, slot, "g1")
    assert message(_conn("m1", MAP)).bucket.ready_event == b""
    assert not message(_conn("b1", BROADCAST)).bucket.HasField("delta")
