"""Both ends of a stream forget keyed contents by one rule, so a key sent alone is known; the
same scheme serves begins, manifests, layouts and a receiver's boxes (protocol §2.1)."""

import queue

import pytest

from weightsync.errors import ProtocolError
from weightsync.receiver.connection import Keeps, KeptByStream, _items
from weightsync.sender.joins import StreamBegins
from weightsync.sender.publish_stream import begin_key
from weightsync.sender.service import take_queued
from weightsync.stream_keys import KEYS_KEPT, KeptByKey, SentKeys
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import ManifestCache


def _keeping() -> SentKeys:
    sent = SentKeys()
    sent.peer_keeps = True
    return sent


def test_sender_and_receiver_forget_at_the_same_moment():
    sent, kept = _keeping(), KeptByKey("k")
    keys = [f"k{i % (KEYS_KEPT + 3)}" for i in range(5 * KEYS_KEPT)]
    for key in keys:
        if not sent.alone(key):
            kept.keep(key, key.upper())
        # What the sender now sends alone, the receiver still has.
        assert kept.get(key) == key.upper()
    assert sent.alone(keys[-1])


def test_contents_sent_before_the_peer_said_it_keeps_are_counted():
    """A publisher's first begin goes before the welcome says ``begin_keys``; the sender kept
    it all the same, so the publisher counts it: both forget at the same 17th key."""
    sent, kept = SentKeys(), KeptByKey("begin_key")
    assert not sent.alone("first")
    kept.keep("first", 0)
    sent.peer_keeps = True
    for i in range(KEYS_KEPT + 1):
        key = "first" if i == 0 else f"k{i}"
        if not sent.alone(key):
            kept.keep(key, i)
        assert kept.get(key) is not None
    assert not sent.alone("first")  # forgotten on both ends by the 17th


def test_a_peer_that_keeps_nothing_always_gets_the_contents():
    sent = SentKeys()
    assert [sent.alone("k") for _ in range(3)] == [False] * 3


def test_a_key_held_nowhere_is_refused_naming_the_field_and_the_key():
    with pytest.raises(ProtocolError, match="version 3: a start came by manifest_key 6b6579 "):
        KeptByKey("manifest_key").held(b"key", "version 3: a start")


def test_a_direct_layout_past_the_bound_is_sent_again_and_found():
    """The sender had kept every layout key forever while the receiver forgot them at 16:
    the 17th distinct layout on a stream, announced by key again, found nothing there."""
    sent, kept = _keeping(), KeptByStream()
    layout = pb.BucketLayout(index=0, is_last=True)
    for rounds in range(2):
        for i in range(KEYS_KEPT + 1):
            key = f"layout {i}".encode()
            bucket = pb.BucketAnnouncement(version=rounds + 1, layout_key=key)
            if not sent.alone(key):
                bucket.layout.CopyFrom(layout)
            out = kept.complete(pb.Announcement(bucket=bucket))
            assert out.WhichOneof("kind") == "bucket", out.abort.reason.message


def test_a_receiver_lists_its_boxes_once_then_their_key():
    """To a sender that keeps boxes by key; to one that does not (an older sender), always
    listed; keeping every tensor whole is said by no boxes and no key."""
    boxes = Keeps([pb.TensorBox(name="w", start=[0], size=[2])], b"m-0")
    for keeps_keys, listed in ((True, [1, 0]), (False, [1, 1])):
        kept = KeptByStream(keeps_keys)
        for want in listed:
            verdict = pb.ManifestVerdict(version=1, accepted=True)
            kept.declare(verdict, boxes)
            assert (verdict.keeps_key, len(verdict.keeps)) == (b"m-0", want)
    verdict = pb.ManifestVerdict(version=1, accepted=True)
    KeptByStream(True).declare(verdict, Keeps([], b"m-0"))
    assert not verdict.keeps_key and not verdict.keeps


def test_a_stream_keeps_every_begin_sent_with_its_contents_not_only_the_last():
    """Two tensor lists published in turn: after the first of each, both go by key alone."""
    begins, manifests = StreamBegins(), ManifestCache()

    def take(version: int, key: bytes, name: str = ""):
        msg = pb.BeginVersion(begin_key=key, manifest=pb.Manifest(version=version))
        if name:
            msg.manifest.tensors.append(pb.TensorSpec(name=name, dtype="float32", shape=[4]))
        manifest, kept = begins.take(msg, "", manifests)
        return manifest.version, [t.name for t in manifest.tensors], kept.manifest_key

    first, second = take(1, b"a", "w"), take(2, b"b", "v")
    assert take(3, b"a") == (3, ["w"], first[2])
    assert take(4, b"b") == (4, ["v"], second[2])
    with pytest.raises(ProtocolError, match="BeginVersion of version 5 came by begin_key 63 "):
        take(5, b"c")


def test_a_begin_key_is_a_digest_of_its_contents_not_of_its_objects():
    manifest = pb.Manifest(version=3, tensors=[pb.TensorSpec(name="w", dtype="float32", shape=[4])])
    again = pb.Manifest()
    again.CopyFrom(manifest)
    again.version = 9  # the version is no part of the contents
    offer = pb.BeginVersion(sources=[pb.BufferHandle(buffer_id="b", nbytes=16)])
    assert begin_key((manifest, offer, False)) == begin_key((again, offer, False))
    assert begin_key((manifest, None, False)) == begin_key((manifest, pb.BeginVersion(), False))
    other = pb.Manifest(tensors=[pb.TensorSpec(name="v", dtype="float32", shape=[4])])
    wholes = [(manifest, offer, False), (manifest, None, False), (manifest, offer, True)]
    assert len({begin_key(whole) for whole in [*wholes, (other, offer, False)]}) == 4


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
