"""Deltas on the wire (protocol §5.1): the payload round trip, the checks made before any
write, and the two ends' kept bytes (``weightsync/transports/broadcast/bases.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from weightsync.delta_wire import element_bytes, from_wire, to_wire
from weightsync.deltas import checksum_of, decode, encode
from weightsync.errors import ProtocolError, WrongBaseError
from weightsync.transports.broadcast import AppliedBases, DeltaBases
from weightsync.v1 import weightsync_pb2 as pb


def versions(n: int = 4096, changed: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, generator=g).to(torch.bfloat16)
    new = old.clone()
    new[torch.randint(0, n, (changed,), generator=g)] = torch.randn(changed, generator=g).to(
        torch.bfloat16
    )
    return old.view(torch.uint8), new.view(torch.uint8)


@pytest.mark.parametrize("clustered", [False, True])
def test_a_delta_crosses_as_one_payload_and_decodes_exactly(clustered):
    old, new = versions()
    if clustered:  # a float32 tensor that changes whole: the XOR form
        new = new.clone()
        new[1024:3072] ^= 0x5A
    delta = encode(old, new, base_version=3, bucket="b", element_bytes=2)
    assert delta.kind == ("xor" if clustered else "indices")
    msg, payload = to_wire(delta)
    assert msg.nbytes == payload.numel() == delta.payload_bytes < new.numel()
    back = from_wire(msg, payload.clone(), new.numel(), "bucket 0 of version 4")
    held = old.clone()
    decode(back, held, base_version=3)
    assert torch.equal(held, new)


def test_parts_laid_end_to_end_in_one_allocation_travel_without_a_copy():
    # The CUDA encoder carves the indices form's parts from one bucket-sized block; anything
    # else (the CPU's parts, the XOR form's) is copied into one payload.
    old, new = versions()
    delta = encode(old, new, base_version=3, bucket="b", element_bytes=2)
    idx, values = delta.parts
    held = torch.empty(new.numel(), dtype=torch.uint8)
    carved = (
        held[: idx.numel() * 4].view(torch.int32),
        held[idx.numel() * 4 : idx.numel() * 6].view(torch.int16),
    )
    carved[0].copy_(idx)
    carved[1].copy_(values)
    apart = to_wire(delta)[1]
    together = to_wire(replace(delta, parts=carved))[1]
    assert together.data_ptr() == held.data_ptr() and apart.data_ptr() != idx.data_ptr()
    assert torch.equal(together, apart)


@pytest.mark.parametrize(
    "spoil",
    [
        lambda m, p: (setattr(m, "form", "gzip") or m, p),
        lambda m, p: (setattr(m, "nbytes", m.nbytes + 4) or m, p),
        lambda m, p: (m, torch.cat([p, p[:4]])),
        lambda m, p: (m, torch.cat([torch.full((4,), 255, dtype=torch.uint8), p[4:]])),
    ],
    ids=["form", "announced size", "payload size", "index outside"],
)
def test_a_payload_that_does_not_fit_its_announcement_is_refused_before_any_write(spoil):
    old, new = versions()
    msg, payload = to_wire(encode(old, new, base_version=1, bucket="b", element_bytes=2))
    msg, payload = spoil(msg, payload)
    with pytest.raises(ProtocolError, match="bucket 0 of version 2"):
        from_wire(msg, payload, new.numel(), "bucket 0 of version 2")


def test_element_bytes_follow_most_of_the_bucket():
    assert element_bytes({2: 1000, 4: 10}) == 2
    assert element_bytes({4: 1000, 2: 10}) == 4
    assert element_bytes({8: 1000}) == 4
    assert element_bytes({}) == 2


AB = frozenset({"a", "b"})


def _layout(nbytes: int, index: int = 0) -> pb.BucketLayout:
    return pb.BucketLayout(index=index, nbytes=nbytes)


def test_the_sender_sends_a_delta_only_from_the_version_the_group_holds():
    old, new = versions()
    bases = DeltaBases(1 << 20)
    layout = _layout(old.numel())
    fake = _FakeBucket()
    assert bases.send(1, fake, layout, old, AB, base=0) is None  # kept, sent in full
    assert bases.send(2, fake, layout, new, AB, base=0) is None  # the group holds nothing
    newer = new.clone()
    newer[:2] ^= 1
    abc = AB | {"c"}
    assert bases.send(3, fake, layout, newer, abc, base=2) is None  # "c" was not sent 2's
    newest = newer.clone()
    newest[8:10] ^= 1
    encoded = bases.send(4, fake, layout, newest, AB, base=3)
    assert encoded is not None and encoded.msg.base_version == 3
    assert encoded.msg.base_checksum == checksum_of(newer)
    assert bases.send(5, fake, layout, newest, AB, base=3) is None  # it keeps 4 now


def test_the_sender_keeps_no_more_than_its_bound():
    old, _ = versions()
    bases = DeltaBases(old.numel())
    fake = _FakeBucket()
    bases.send(1, fake, _layout(old.numel(), 0), old, AB, base=0)
    bases.send(1, fake, _layout(old.numel(), 1), old, AB, base=0)  # over the bound: not kept
    assert bases.send(2, fake, _layout(old.numel(), 1), old, AB, base=1) is None
    assert sum(b.data.numel() for b in bases._kept.values()) <= old.numel()


def test_the_receiver_refuses_a_delta_onto_bytes_that_changed_before_any_write():
    old, new = versions()
    kept = AppliedBases(1 << 20, torch.device("cpu"))
    kept.arrive(1)
    kept.slot(0, old.numel()).copy_(old)
    assert kept.applied(pb.VersionEnd(version=1, checksums=[checksum_of(old)]))
    kept._kept[0].data[5] ^= 1  # the planted fault
    kept.arrive(2)
    assert isinstance(kept.error, WrongBaseError) and "bucket 0" in str(kept.error)
    msg, payload = to_wire(encode(old, new, base_version=1, bucket="b", element_bytes=2))
    ann = pb.BucketAnnouncement(version=2, layout=_layout(old.numel()), delta=msg)
    assert kept.decode(ann, payload) is None
    assert not kept.applied(pb.VersionEnd(version=2, checksums=[checksum_of(new)]))


def test_the_receiver_applies_a_delta_onto_what_it_kept_and_holds_the_result():
    old, new = versions()
    kept = AppliedBases(1 << 20, torch.device("cpu"))
    kept.arrive(1)
    kept.slot(0, old.numel()).copy_(old)
    kept.applied(pb.VersionEnd(version=1, checksums=[checksum_of(old)]))
    msg, payload = to_wire(encode(old, new, base_version=1, bucket="b", element_bytes=2))
    kept.arrive(2)
    ann = pb.BucketAnnouncement(version=2, layout=_layout(old.numel()), delta=msg)
    assert torch.equal(kept.decode(ann, payload), new)
    assert kept.applied(pb.VersionEnd(version=2, checksums=[checksum_of(new)]))
    stale = pb.BucketAnnouncement(version=3, layout=_layout(old.numel()), delta=msg)
    kept.arrive(3)
    assert kept.decode(stale, payload) is None  # made from version 1; it holds 2
    assert isinstance(kept.error, WrongBaseError)


class _FakeBucket:
    """A bucket of bf16 bytes (only its entries' element sizes are read)."""

    entries = ()
