"""Source regions: the packer that gathers strided views into buckets, and their wire form."""

from __future__ import annotations

import pytest
import torch

from weightsync.buckets import ChunkAssembler, TensorSpec, plan_buckets, unpack_bucket
from weightsync.errors import ProtocolError
from weightsync.regions import CopyBatch, Region, pack_regions, whole
from weightsync.wire import regions_from_pb, regions_to_pb


def _gathered(cap: int):
    """A [12, 8] fp32 tensor split by columns over two "ranks" (TP row-parallel), a [10] bf16
    tensor split by rows, and a scalar; each source is a strided view of one flat buffer."""
    g = torch.Generator().manual_seed(0)
    flat0 = torch.randn(200, generator=g)
    flat1 = torch.randn(200, generator=g)
    half = torch.randn(10, generator=g).to(torch.bfloat16)
    w = torch.cat([flat0[:48].view(12, 4), flat1[:48].view(12, 4)], dim=1)
    regions = {
        "w": [Region((0, 0), flat0[:48].view(12, 4)), Region((0, 4), flat1[:48].view(12, 4))],
        "b": [Region((0,), half[:6]), Region((6,), half[6:])],
        "s": [Region((), flat0[100])],
    }
    tensors = {"w": w, "b": half, "s": flat0[100].clone()}
    specs = [TensorSpec.of(n, t) for n, t in tensors.items()]
    return regions, tensors, plan_buckets(specs, cap)


@pytest.mark.parametrize("cap", [256, 512, 4096])
def test_pack_regions_gathers_pieces_into_buckets_bit_exact(cap):
    regions, tensors, plan = _gathered(cap)
    assembler, out = ChunkAssembler(), {}
    for bucket in plan.buckets:
        buffer = torch.zeros(cap, dtype=torch.uint8)
        for entry in bucket.entries:
            pack_regions(buffer, entry, regions[entry.name])
        out.update(dict(unpack_bucket(buffer, bucket, assembler)))
    assert set(out) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(
            out[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
        )


@pytest.mark.parametrize("cap", [256, 512, 4096])
@pytest.mark.parametrize(
    ("start", "size"), [((3, 2), (5, 4)), ((0, 4), (12, 4)), ((6, 0), (6, 8)), ((11, 7), (1, 1))]
)
def test_a_box_of_a_tensor_packs_from_the_regions_that_cross_it(cap, start, size):
    """A slice group's bucket holds only a box of ``w`` (across both ranks' columns), chunked
    by the box's rows when it does not fit."""
    regions, tensors, _ = _gathered(cap)
    spec = TensorSpec("w", "float32", size)
    plan = plan_buckets([spec], cap, first_index=5, box_starts={"w": start})
    assert plan.buckets[0].index == 5 and plan.buckets[-1].is_last
    assembler, out = ChunkAssembler(), {}
    for bucket in plan.buckets:
        assert all(e.box_start == start for e in bucket.entries)
        buffer = torch.zeros(cap, dtype=torch.uint8)
        for entry in bucket.entries:
            pack_regions(buffer, entry, regions[entry.name])
        out.update(dict(unpack_bucket(buffer, bucket, assembler)))
    want = tensors["w"][start[0] : start[0] + size[0], start[1] : start[1] + size[1]]
    assert torch.equal(out["w"], want)


def test_pack_regions_casts_to_the_manifest_dtype():
    src = torch.randn(4, 8)
    spec = TensorSpec("w", "bfloat16", (4, 8))
    (bucket,) = plan_buckets([spec], 4096).buckets
    buffer = torch.zeros(4096, dtype=torch.uint8)
    pack_regions(buffer, bucket.entries[0], whole({"w": src})["w"])
    ((_, got),) = unpack_bucket(buffer, bucket, ChunkAssembler())
    assert torch.equal(got, src.to(torch.bfloat16))


def test_regions_round_trip_through_the_wire_as_views_of_the_sources():
    regions, _, _ = _gathered(4096)
    storages = {}

    def locate(t):
        storage = t.untyped_storage()
        index = storages.setdefault(storage.data_ptr(), (len(storages), storage))[0]
        return index, t.storage_offset() * t.element_size()

    pieces = regions_to_pb(regions, locate)
    flats = [None] * len(storages)
    for index, storage in storages.values():
        flats[index] = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    back = regions_from_pb(pieces, flats)
    for name, parts in regions.items():
        assert [r.dst_start for r in back[name]] == [r.dst_start for r in parts]
        for got, want in zip(back[name], parts, strict=True):
            assert got.source.data_ptr() == want.source.data_ptr()
            assert torch.equal(got.source, want.source)


def test_a_piece_still_being_written_comes_back_with_its_ready_event():
    regions = whole({"a": torch.zeros(4), "b": torch.ones(4)})
    pieces = regions_to_pb(regions, lambda t: (0, 0), {"b": 1})
    assert [p.ready for p in pieces] == [0, 1]
    event = object()  # an opened CUDA event on a GPU; only passed through here
    back = regions_from_pb(pieces, [torch.zeros(16, dtype=torch.uint8)], [event])
    assert (back["a"][0].ready, back["b"][0].ready) == (None, event)
    with pytest.raises(ProtocolError, match="piece of 'b' names ready event 1 of 0"):
        regions_from_pb(pieces, [torch.zeros(16, dtype=torch.uint8)])


def test_a_piece_reaching_past_its_source_is_refused_by_name():
    pieces = regions_to_pb(whole({"layers.0.w": torch.zeros(4, 4)}), lambda t: (0, 0))
    with pytest.raises(ProtocolError, match="'layers.0.w' reaches byte 64 of a 32-byte source"):
        regions_from_pb(pieces, [torch.zeros(32, dtype=torch.uint8)])


@pytest.mark.parametrize("reused", [False, True])
def test_the_kernel_takes_large_contiguous_copies_only_in_a_batch_that_is_reused(
    monkeypatch, reused
):
    """A reused batch builds its table once, so large copies join the one launch; a batch run
    once keeps them as a ``copy_`` each (its table would cost more than the launches save).
    The kernel itself needs a GPU: here it only records what it was given."""
    import weightsync.regions as regions
    from weightsync import copy_kernel

    given = []
    monkeypatch.setattr(regions, "FOREACH_MAX_BYTES", 64)
    monkeypatch.setattr(copy_kernel, "fits", lambda dst, src: True)
    monkeypatch.setattr(copy_kernel, "available", lambda device: True)
    monkeypatch.setattr(copy_kernel, "ChunkedCopies", lambda pairs: given.append(pairs))
    small = (torch.zeros(4), torch.ones(4))
    large = (torch.zeros(100), torch.ones(100))
    strided = (torch.zeros(8, 8)[:, :4], torch.ones(8, 4))
    batch = regions.CopyBatch.of([small, large, strided], reused=reused)
    kernel = [d for pairs in given for d, _ in pairs]
    assert len(given) == 1 and kernel[0] is small[0] and kernel[-1] is strided[0]
    if reused:
        assert kernel[1] is large[0] and not batch.one_by_one
    else:
        assert len(kernel) == 2 and [d for d, _ in batch.one_by_one] == [large[0]]


def test_a_copy_batch_copies_small_pairs_in_one_launch_and_large_ones_alone(monkeypatch):
    import weightsync.regions as regions

    monkeypatch.setattr(regions, "FOREACH_MAX_BYTES", 64)
    g = torch.Generator().manual_seed(3)
    small = [(torch.zeros(4), torch.randn(4, generator=g)) for _ in range(3)]
    cast = (torch.zeros(8, dtype=torch.bfloat16), torch.randn(8, generator=g))
    large = (torch.zeros(100), torch.randn(100, generator=g))
    batch = regions.CopyBatch.of([*small, cast, large])
    # The rest one by one, largest first (their launches queue behind the big copies).
    assert len(batch.dsts) == 3 and [d for d, _ in batch.one_by_one] == [large[0], cast[0]]
    launches = []
    real = torch._foreach_copy_
    counted = lambda *a, **k: (launches.append(1), real(*a, **k))  # noqa: E731
    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    batch.run()
    assert launches == [1]
    for dst, src in [*small, cast, large]:
        assert torch.equal(dst, src.to(dst.dtype))


def test_a_copy_batch_moves_bits_nan_payloads_included():
    from weightsync.regions import CopyBatch

    payloads = torch.tensor([0x7F81, 0xFFC1, 0x7FC0, 0x0001, 0x8000], dtype=torch.int32)
    src = payloads.to(torch.int16).view(torch.bfloat16)
    dst = torch.zeros_like(src)
    CopyBatch.of([(dst, src)]).run()
    assert torch.equal(dst.view(torch.int16), src.view(torch.int16))


def _experts(e: int = 6, h: int = 4, i: int = 8, pad: int = 3):
    """A fused ``w2 [E, H, I]`` and a TP=2 trainer rank's flat buffer holding each expert's
    second column half ``[H, I/2]`` contiguous, one after another ``pad`` elements apart."""
    g = torch.Generator().manual_seed(5)
    flat = torch.randn(e * (h * i // 2 + pad), generator=g)
    step = h * i // 2 + pad
    pieces = [flat[k * step : k * step + h * i // 2].view(h, i // 2) for k in range(e)]
    return torch.zeros(e, h, i), pieces


def _count(batch: CopyBatch) -> int:
    return len(batch.dsts) + len(batch.one_by_one) + sum(len(c.pairs) for c in batch.chunked)


def test_the_same_box_of_every_expert_is_copied_as_one_strided_copy():
    w2, pieces = _experts()
    pairs = [(w2[k][:, 4:], piece) for k, piece in enumerate(pieces)]
    batch = CopyBatch.of(reversed(pairs))  # any order: runs are found by address
    assert _count(batch) == 1
    batch.run()
    assert torch.equal(w2[:, :, 4:], torch.stack(pieces)) and not w2[:, :, :4].any()


def test_boxes_at_uneven_steps_or_overlapping_destinations_stay_apart():
    w2, pieces = _experts()
    odd = pieces[:3] + [pieces[4], pieces[5], pieces[3].clone()]  # the last one elsewhere
    batch = CopyBatch.of([(w2[k][:, 4:], p) for k, p in enumerate(odd)])
    assert _count(batch) == 3  # experts 0-2, 3-4 (an even step again), 5
    batch.run()
    assert torch.equal(w2[:, :, 4:], torch.stack(odd))
    rows = torch.zeros(8, 4)
    overlapping = [(rows[k : k + 2, :2], torch.full((2, 2), float(k))) for k in range(3)]
    assert _count(CopyBatch.of(overlapping)) == 3
    whole = [(torch.zeros(4), torch.ones(4)) for _ in range(3)]  # contiguous: left as they are
    assert _count(CopyBatch.of(whole)) == 3
