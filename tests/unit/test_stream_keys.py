"""Both ends of a stream forget keyed contents by one rule, so a key sent alone is known."""

import queue

from weightsync.errors import ProtocolError
from weightsync.receiver.connection import KeptByStream, _items
from weightsync.sender.service import take_queued
from weightsync.stream_keys import KEYS_KEPT, KeptByKey, SentKeys
from weightsync.v1 import weightsync_pb2 as pb


def test_sender_and_receiver_forget_at_the_same_moment():
    sent, kept = SentKeys(), KeptByKey()
    keys = [f"k{i % (KEYS_KEPT + 3)}" for i in range(5 * KEYS_KEPT)]
    for key in keys:
        if sent.needs(key):
            kept.keep(key, key.upper())
        # What the sender now sends alone, the receiver still has.
        assert kept.get(key) == key.upper()
    assert not sent.needs(keys[-1])


def test_a_direct_layout_past_the_bound_is_sent_again_and_found():
    """The sender had kept every layout key forever while the receiver forgot them at 16:
    the 17th distinct layout on a stream, announced by key again, found nothing there."""
    sent, kept = SentKeys(), KeptByStream()
    layout = pb.BucketLayout(index=0, is_last=True)
    for rounds in range(2):
        for i in range(KEYS_KEPT + 1):
            key = f"layout {i}".encode()
            bucket = pb.BucketAnnouncement(version=rounds + 1, layout_key=key)
            if sent.needs(key):
                bucket.layout.CopyFrom(layout)
            out = kept.complete(pb.Announcement(bucket=bucket))
            assert out.WhichOneof("kind") == "bucket", out.abort.reason.message


def test_queued_announcements_go_together_and_the_stream_end_after_them():
    outbox: queue.Queue = queue.Queue()
    start, end = pb.Announcement(start=pb.VersionStart()), pb.Announcement(end=pb.VersionEnd())
    for item in (start, end, None):
        outbox.put(item)
    items, stop = take_queued(outbox, 64)
    assert items == [start, end] and stop is None
    for item in (start, end, ProtocolError("refused")):
        outbox.put(item)
    items, stop = take_queued(outbox, 1)
    assert items == [start] and stop is not None and not isinstance(stop, Exception)
    items, stop = take_queued(outbox, 64)
    assert items == [end] and isinstance(stop, ProtocolError)


def test_a_batch_is_read_in_order_nested_or_not():
    a, b, c = (pb.Announcement(end=pb.VersionEnd(version=v)) for v in (1, 2, 3))
    inner = pb.Announcement(batch=pb.AnnouncementBatch(items=[b, c]))
    outer = pb.Announcement(batch=pb.AnnouncementBatch(items=[a, inner]))
    assert [m.end.version for m in _items(outer)] == [1, 2, 3]
    assert list(_items(a)) == [a]
