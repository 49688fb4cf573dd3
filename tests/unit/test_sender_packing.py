"""The sender packing buckets itself from offered memory (a shm buffer, mapped here)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.sender_parts import sender_parts
from weightsync.buckets import TensorSpec
from weightsync.errors import TransportError
from weightsync.manifest import VersionManifest
from weightsync.regions import Region
from weightsync.sender.offer import rank_offer
from weightsync.sender.packing import MappedOffers, pack_bucket, received_sources
from weightsync.sender.planner import plan_tensors
from weightsync.sender.slots import SlotPool
from weightsync.sender.version import Version
from weightsync.transports import get_transport
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import regions_to_pb

CPU = torch.device("cpu")
SHM = get_transport("shm")
MANIFEST = VersionManifest(1, tuple(TensorSpec(f"w{i}", "float32", (64,)) for i in range(4)))


def _offer_key(begins):
    """The offer key the sender computes of these begins (one rank_offer per rank)."""
    return tuple(rank_offer(begins[r], "") for r in sorted(begins))


@pytest.fixture
def offered():
    """One rank offering every tensor of a shm buffer filled with 0, 1, 2, ... (w0 in two
    pieces), and the values each tensor must be packed with."""
    storage = SHM.allocate(4096, CPU)
    flat = storage.tensor.view(torch.float32)
    flat.copy_(torch.arange(flat.numel(), dtype=torch.float32))
    regions = {f"w{i}": [Region((0,), flat[64 * i : 64 * i + 64])] for i in (1, 2, 3)}
    regions["w0"] = [Region((0,), flat[256:288]), Region((32,), flat[320:352])]
    begin = pb.BeginVersion(sources=[storage.handle])
    begin.pieces.extend(
        regions_to_pb(regions, lambda t: (0, t.storage_offset() * t.element_size()))
    )
    # As the publisher's begin arrives on a lane: with the descriptor of its shm file.
    mapped = received_sources(begin, [os.open(storage.handle.shm.path, os.O_RDONLY)], 0)
    want = {f"w{i}": flat[64 * i : 64 * i + 64].clone() for i in (1, 2, 3)}
    want["w0"] = torch.cat([flat[256:288], flat[320:352]])
    yield {0: begin}, want
    del mapped
    SHM.release(storage)


@pytest.fixture
def slots():
    pool = SlotPool(2, 1024)
    pool.reallocate(1024, CPU, SHM)
    yield pool
    pool.close()


def test_the_sender_packs_exactly_the_offered_bytes_and_reuses_its_copies(offered, slots):
    begins, want = offered
    tensors = plan_tensors(MANIFEST, begins, False, 1024)
    assert tensors.sender_packs
    regions = MappedOffers().regions(_offer_key(begins), begins)
    shared = sender_parts().shared
    run = Version(MANIFEST, tensors, "p", "shm", {}, shared=shared, regions=regions)
    slot = slots.slots[0]
    for bucket in tensors.staged.buckets:
        slot.buffer.tensor.zero_()
        pack_bucket(run, bucket, slot)
        for entry in bucket.entries:
            got = slot.buffer.tensor[entry.offset : entry.offset + entry.nbytes]
            assert torch.equal(got.view(torch.float32), want[entry.name]), entry.name
    copies = slot.copies
    assert sorted(copies.by_bucket) == [b.index for b in tensors.staged.buckets]
    pack_bucket(run, tensors.staged.buckets[0], slot)
    assert slot.copies is copies  # same plan and regions: the copies worked out once
    replanned = plan_tensors(MANIFEST, begins, False, 1024)
    other = Version(MANIFEST, replanned, "p", "shm", {}, shared=shared, regions=regions)
    pack_bucket(other, tensors.staged.buckets[0], slot)
    assert slot.copies is not copies and list(slot.copies.by_bucket) == [0]


def test_offered_memory_is_mapped_once_per_offer(offered):
    begins, _ = offered
    mapped = MappedOffers()
    first = mapped.regions(_offer_key(begins), begins)
    assert first is not None and sorted(first) == ["w0", "w1", "w2", "w3"]
    assert mapped.regions(_offer_key(begins), begins) is first


def test_memory_that_does_not_map_here_leaves_the_packing_to_the_publishers(offered, caplog):
    begins, _ = offered
    gone = pb.BufferHandle(
        buffer_id="gone", nbytes=4096, shm=pb.ShmHandle(path="/dev/shm/weightsync-no-such-file")
    )
    begin = pb.BeginVersion(sources=[gone], pieces=begins[0].pieces)
    assert MappedOffers().regions(_offer_key({0: begin}), {0: begin}) is None
    assert "the publishers pack" in caplog.text


class _Event:
    """Stands in for a publisher's ready event (CUDA only): done after ``after`` looks."""

    def __init__(self, after: int) -> None:
        self.after, self.looks = after, 0

    def query(self) -> bool:
        self.looks += 1
        return self.looks > self.after


def test_a_piece_still_being_written_is_packed_once_its_event_fired_or_fails_the_bucket(
    offered, slots, monkeypatch
):
    begins, want = offered
    tensors = plan_tensors(MANIFEST, begins, False, 1024)
    mapped = MappedOffers().regions(_offer_key(begins), begins)
    soon, never = _Event(after=3), _Event(after=10**9)
    regions = {
        name: [Region(r.dst_start, r.source, soon) for r in rs] for name, rs in mapped.items()
    }
    shared = sender_parts().shared
    run = Version(MANIFEST, tensors, "p", "shm", {}, shared=shared, regions=regions)
    slot = slots.slots[0]
    bucket = tensors.staged.buckets[0]
    pack_bucket(run, bucket, slot)
    assert soon.looks == 4  # polled until it fired, once for every piece of the bucket
    entry = bucket.entries[0]
    got = slot.buffer.tensor[entry.offset : entry.offset + entry.nbytes]
    assert torch.equal(got.view(torch.float32), want[entry.name])

    # Another offer (regions are never changed in place: the copies are kept by their identity).
    waiting = {
        **regions,
        entry.name: [Region(r.dst_start, r.source, never) for r in regions[entry.name]],
    }
    monkeypatch.setattr(shared.settings, "pack_timeout_s", 0.05)
    late = Version(MANIFEST, tensors, "p", "shm", {}, shared=shared, regions=waiting)
    with pytest.raises(
        TransportError,
        match=rf"version 1, bucket 0 \(packed by the sender\): the work queued on the stream of "
        rf"the ready event of '{entry.name}' was not done within 0.05 s",
    ):
        pack_bucket(late, bucket, slot)
