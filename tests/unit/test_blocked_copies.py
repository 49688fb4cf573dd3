"""CPU copies that take the bucket checksum on the way (:mod:`weightsync.blocked_copies`):
bit-exact, and the very checksum a second read (``row_sums``) gives, on every path."""

from __future__ import annotations

import pytest
import torch

from weightsync import summed_copies
from weightsync.blocked_copies import BlockedCopies, plan_steps
from weightsync.buckets import TensorSpec, pack_entry, plan_buckets
from weightsync.checksum import finish, row_sums
from weightsync.errors import ChecksumError
from weightsync.regions import CopyBatch, Region, region_copies

# Odd sizes: tails shorter than a 64 KiB row, padding between entries, 0-dim and empty tensors.
SHAPES = {"a": (3, 5), "b": (40000,), "c": (257, 129), "d": (), "e": (0, 4), "f": (70001,)}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in SHAPES.items()}


def _pack_reference(bucket, tensors) -> torch.Tensor:
    """The bucket as the old path packs it: every entry copied, the padding zero."""
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    for entry in bucket.entries:
        pack_entry(buffer, entry, tensors[entry.name])
    return buffer


def _checksum(buffer: torch.Tensor, nbytes: int) -> int:
    return finish(row_sums(buffer, nbytes), nbytes)


def _break(monkeypatch, which) -> None:
    """Flip a bit of each copied piece ``which`` picks, right after its copy."""
    real = BlockedCopies._copy

    def copy(step) -> None:
        real(step)
        for piece in step.pieces:
            if which(piece):
                piece.dst.view(-1).view(torch.uint8)[0] ^= 1

    monkeypatch.setattr(BlockedCopies, "_copy", staticmethod(copy))


def _pack_pairs(bucket, buffer, regions):
    pairs, names = [], []
    for entry in bucket.entries:
        for pair in region_copies(buffer, entry, regions[entry.name]):
            pairs.append(pair)
            names.append(entry.name)
    return pairs, names


@pytest.mark.parametrize("block", [256, 4096, 1 << 16, 2 << 20])
@pytest.mark.parametrize("cap", [1 << 16, 1 << 20])
def test_a_pack_is_bit_exact_and_checksums_as_a_second_read(block, cap):
    tensors = _tensors()
    regions = {n: [Region((0,) * t.dim(), t)] for n, t in tensors.items()}
    plan = plan_buckets([TensorSpec.of(n, t) for n, t in tensors.items()], cap)
    assert any(e.is_chunked for b in plan.buckets for e in b.entries) == (cap == 1 << 16)
    for bucket in plan.buckets:
        want = _pack_reference(bucket, tensors)
        buffer = torch.full((bucket.nbytes + 512,), 0xA5, dtype=torch.uint8)
        bucket.zero_gaps(buffer)  # as the sender does before the copies
        pairs, names = _pack_pairs(bucket, buffer, regions)
        copies = BlockedCopies.plan(
            pairs, buffer, bucket.nbytes, destination=True, names=names, block=block
        )
        sums = copies.run(check="v1")
        assert torch.equal(buffer[: bucket.nbytes], want)
        assert finish(sums, bucket.nbytes) == _checksum(want, bucket.nbytes)
        # Every version again, from the same views: the same value.
        assert finish(copies.run(check="v2"), bucket.nbytes) == _checksum(want, bucket.nbytes)


def test_interleaved_tp_pieces_and_a_cast_pack_exactly():
    """A tensor gathered from two TP shards' column halves (strided pieces that interleave in
    the bucket) and one cast from float32."""
    g = torch.Generator().manual_seed(1)
    left, right = torch.randn(300, 64, generator=g), torch.randn(300, 64, generator=g)
    wide = torch.randn(999, generator=g)
    specs = [TensorSpec("w", "float32", (300, 128)), TensorSpec("x", "bfloat16", (999,))]
    (bucket,) = plan_buckets(specs, 1 << 20).buckets
    regions = {"w": [Region((0, 0), left), Region((0, 64), right)], "x": [Region((0,), wide)]}
    whole = {"w": torch.cat([left, right], dim=1), "x": wide.to(torch.bfloat16)}
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pairs, names = _pack_pairs(bucket, buffer, regions)
    copies = BlockedCopies.plan(
        pairs, buffer, bucket.nbytes, destination=True, names=names, block=4096
    )
    sums = copies.run(check="v")
    want = _pack_reference(bucket, whole)
    assert torch.equal(buffer, want)
    assert finish(sums, bucket.nbytes) == _checksum(want, bucket.nbytes)


def test_a_receiver_read_sums_the_bucket_once_whatever_it_reads():
    """Reads of part of the bucket (a tensor skipped, one read twice, chunks in place): the
    copies land exactly and the checksum is the whole bucket's."""
    tensors = _tensors(2)
    plan = plan_buckets([TensorSpec.of(n, t) for n, t in tensors.items()], 1 << 16)
    for bucket in plan.buckets:
        buffer = _pack_reference(bucket, tensors)
        live = {n: torch.zeros_like(t) for n, t in tensors.items()}
        twice = torch.zeros_like(tensors["c"])
        pairs = []
        for entry in bucket.entries:
            if entry.name == "a":
                continue  # not kept here: summed, not copied
            view = buffer[entry.offset : entry.offset + entry.nbytes]
            dst = live[entry.name].view(-1).view(torch.uint8)
            pairs.append((dst[entry.tensor_offset : entry.tensor_offset + entry.nbytes], view))
            if entry.name == "c" and not entry.is_chunked:
                pairs.append((twice.view(-1).view(torch.uint8), view))
        batch = summed_copies.copies(pairs, buffer, bucket.nbytes, destination=False)
        assert isinstance(batch, BlockedCopies)
        assert finish(batch.run(), bucket.nbytes) == _checksum(buffer, bucket.nbytes)
        for entry in bucket.entries:
            if entry.name != "a":
                got = live[entry.name].view(-1).view(torch.uint8)
                want = tensors[entry.name].reshape(-1).view(torch.uint8)
                span = slice(entry.tensor_offset, entry.tensor_offset + entry.nbytes)
                assert torch.equal(got[span], want[span])
        if any(e.name == "c" and not e.is_chunked for e in bucket.entries):
            assert torch.equal(twice, tensors["c"])


def test_every_row_is_summed_once_in_order():
    buffer = torch.zeros(3 << 16 | 768, dtype=torch.uint8)
    pairs = [
        (buffer[at : at + n], torch.zeros(n, dtype=torch.uint8))
        for at, n in ((0, 100), (70000, 9000), (196608, 512))
    ]
    steps = plan_steps(pairs, buffer.data_ptr(), buffer.numel(), destination=True, block=4096)
    bounds = [(a, b) for _, a, b in steps]
    assert bounds[0][0] == 0 and bounds[-1][1] == buffer.numel()
    assert all(b1 == a2 for (_, b1), (a2, _) in zip(bounds, bounds[1:], strict=False))
    assert sum(len(p) for p, _, _ in steps) == 1 + 3 + 1  # 9000 bytes cut at 4096


def test_a_copy_outside_the_bucket_is_left_to_the_plain_path():
    buffer = torch.zeros(1024, dtype=torch.uint8)
    elsewhere = torch.zeros(256, dtype=torch.uint8)
    pair = (elsewhere, buffer[:256])
    assert BlockedCopies.plan([pair], buffer, 1024, destination=True) is None
    assert isinstance(summed_copies.copies([pair], buffer, 1024, destination=True), CopyBatch)


def test_a_planted_corruption_is_caught_naming_the_tensor(monkeypatch):
    """A copy that writes a wrong bit fails the pack at once, naming its tensor; a bucket
    corrupted after the pack reads with another checksum than the one announced."""
    tensors = _tensors(3)
    regions = {n: [Region((0,) * t.dim(), t)] for n, t in tensors.items()}
    (bucket,) = plan_buckets([TensorSpec.of(n, t) for n, t in tensors.items()], 1 << 20).buckets
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pairs, names = _pack_pairs(bucket, buffer, regions)
    copies = BlockedCopies.plan(
        pairs, buffer, bucket.nbytes, destination=True, names=names, block=4096
    )
    announced = finish(copies.run(check="v1"), bucket.nbytes)
    (c,) = [e for e in bucket.entries if e.name == "c"]
    with monkeypatch.context() as patch:
        _break(patch, lambda p: p.dst.data_ptr() == buffer.data_ptr() + c.offset)
        with pytest.raises(ChecksumError, match="v2: tensor 'c' was packed wrong"):
            copies.run(check="v2")
    copies.run(check="v3")
    buffer[c.offset + 1001] ^= 0x10  # in the staging buffer, after the pack
    live = {n: torch.empty_like(t) for n, t in tensors.items()}
    reads = [(live[e.name].reshape(-1).view(torch.uint8), buffer[e.offset : e.offset + e.nbytes])
             for e in bucket.entries]  # fmt: skip
    batch = summed_copies.copies(reads, buffer, bucket.nbytes, destination=False)
    assert finish(batch.run(), bucket.nbytes) != announced


def test_the_publishers_pack_copies_and_checks_in_one_pass(monkeypatch):
    from weightsync.blocked_copies import CheckedPacks

    pack_checked = CheckedPacks()

    tensors = _tensors(4)
    plan = plan_buckets([TensorSpec.of(n, t) for n, t in tensors.items()], 1 << 16)
    for bucket in plan.buckets:
        buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        assert pack_checked("v1", bucket, buffer, tensors)
        assert torch.equal(buffer, _pack_reference(bucket, tensors))
    # Not contiguous: left to pack_entry and verify_entry, nothing written.
    strided = {**tensors, "c": torch.randn(129, 257).to(torch.bfloat16).t()}
    (bucket,) = [b for b in plan.buckets if any(e.name == "c" for e in b.entries)][:1]
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    assert not pack_checked("v1", bucket, buffer, strided)
    assert not buffer.any()
    _break(monkeypatch, lambda p: True)
    with pytest.raises(ChecksumError, match="v2: tensor '.' was packed wrong"):
        pack_checked("v2", bucket, buffer, tensors)


def test_a_publishers_packs_are_planned_once_per_bucket_buffer_and_tensors(monkeypatch):
    from weightsync import blocked_copies

    planned = []
    real = blocked_copies.checked_pack
    monkeypatch.setattr(
        blocked_copies, "checked_pack", lambda *a: planned.append(a[0].index) or real(*a)
    )
    packs, tensors = blocked_copies.CheckedPacks(), _tensors(5)
    plan = plan_buckets([TensorSpec.of(n, t) for n, t in tensors.items()], 1 << 16)
    buffers = [torch.zeros(b.nbytes, dtype=torch.uint8) for b in plan.buckets]
    for step in range(3):  # versions: the same tensors, new values written in place
        for t in tensors.values():
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(step)))
        for bucket, buffer in zip(plan.buckets, buffers, strict=True):
            assert packs(f"v{step}", bucket, buffer, tensors)
            assert torch.equal(buffer, _pack_reference(bucket, tensors))
    assert planned == [b.index for b in plan.buckets]  # the first version's only
    moved = {**tensors, "a": tensors["a"].clone()}  # a new mapping: planned again, its bytes
    assert packs("v3", plan.buckets[0], buffers[0], moved)
    assert torch.equal(buffers[0], _pack_reference(plan.buckets[0], moved))
    assert planned[-1] == plan.buckets[0].index and len(planned) == len(plan.buckets) + 1
