"""Batched copies on CUDA move bits, not values: on bf16 views of random bytes the fused
``_foreach_copy_`` kernel changed some bit patterns (likely NaN payloads; found by the node
bench on H200)."""

from __future__ import annotations

import pytest
import torch

from tests.support import kernel_cases
from weightsync.regions import CopyBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_batched_copies_of_byte_buffer_views_are_bit_exact(dtype):
    g = torch.Generator("cuda").manual_seed(0)
    src_flat = torch.empty(1 << 20, dtype=torch.uint8, device="cuda").random_(0, 256, generator=g)
    dst_flat = torch.zeros_like(src_flat)
    pairs, offset = [], 0
    for n in (7168, 1024, 65536, 3 << 18):
        pairs.append(
            (dst_flat[offset : offset + n].view(dtype), src_flat[offset : offset + n].view(dtype))
        )
        offset += n
    CopyBatch.of(pairs).run()
    torch.cuda.synchronize()
    assert torch.equal(dst_flat[:offset], src_flat[:offset])


def test_one_launch_copies_every_contiguous_view_bit_for_bit_aligned_or_not():
    """The batched kernel (with CuPy): views at odd element offsets (2-byte aligned), sizes
    that are no multiple of 16, copies of many chunks, and a large one (torch's own ``copy_``
    without the kernel), between two byte buffers."""
    pytest.importorskip("cupy")
    from weightsync import copy_kernel
    from weightsync.regions import FOREACH_MAX_BYTES

    g = torch.Generator("cuda").manual_seed(1)
    src_flat = torch.empty(24 << 20, dtype=torch.uint8, device="cuda").random_(0, 256, generator=g)
    dst_flat = torch.zeros_like(src_flat)
    pairs, offset, covered = [], 0, []
    for n, skew in (
        (7168, 0),
        (1026, 2),
        (65536, 6),
        (3 << 20, 0),
        (9 * copy_kernel.CHUNK_BYTES + 34, 2),
        (FOREACH_MAX_BYTES + 4098, 4),
    ):
        offset += skew
        pairs.append(
            (
                dst_flat[offset : offset + n].view(torch.bfloat16),
                src_flat[offset : offset + n].view(torch.bfloat16),
            )
        )
        covered.append((offset, offset + n))
        offset += n
    once = CopyBatch.of(pairs)  # a batch run once leaves the large copy to torch
    assert len(once.chunked) == 1 and [d for d, _ in once.one_by_one] == [pairs[-1][0]]
    batch = CopyBatch.of(pairs, reused=True)
    assert len(batch.chunked) == 1 and not batch.dsts and not batch.one_by_one
    for _ in range(2):  # the table is built once and copies again
        dst_flat.zero_()
        batch.run()
        torch.cuda.synchronize()
        for a, b in covered:
            assert torch.equal(dst_flat[a:b], src_flat[a:b]), (a, b)
        gaps = torch.ones_like(dst_flat, dtype=torch.bool)
        for a, b in covered:
            gaps[a:b] = False
        assert not dst_flat[gaps].any()  # nothing written outside the views


def test_strided_copies_go_in_the_one_launch_and_move_exactly_their_bytes():
    """Column shards either way, a stack, wide rows, rows aligned to 16 down to 1 byte (the
    cases of ``tests/support/kernel_cases.py``, which the CPU runs in the kernel's source)."""
    pytest.importorskip("cupy")
    g = torch.Generator("cuda").manual_seed(2)
    a_bytes, b_bytes = kernel_cases.STRIDED_BYTES
    a = torch.empty(a_bytes, dtype=torch.uint8, device="cuda").random_(0, 256, generator=g)
    b = torch.empty(b_bytes, dtype=torch.uint8, device="cuda").random_(0, 256, generator=g)
    want = a.clone()
    for dst, src in kernel_cases.strided(want, b):
        dst.copy_(src)
    batch = CopyBatch.of(kernel_cases.strided(a, b))
    assert len(batch.chunked) == 1 and not batch.dsts and not batch.one_by_one
    batch.run()
    torch.cuda.synchronize()
    assert torch.equal(a, want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_copies_from_another_gpu_into_tensors_and_boxes_are_bit_exact():
    """Copies from GPU 1 into GPU 0 beside a local one: a whole tensor, a contiguous shard into
    a column box of a row-major weight and back; nothing written outside the boxes, again on a
    second run. With CuPy two are queued on GPU 1's copy engines."""
    from weightsync import copy_kernel

    g = torch.Generator("cuda:1").manual_seed(2)
    far = torch.empty(64, 96, dtype=torch.int16, device="cuda:1").random_(generator=g)
    far_shard = far[:, 32:64].contiguous()
    near = torch.zeros(64, 96, dtype=torch.int16, device="cuda:0")
    near_shard = torch.zeros(64, 32, dtype=torch.int16, device="cuda:0")
    whole = torch.zeros(64, 96, dtype=torch.int16, device="cuda:0")
    local_src = torch.arange(4096, dtype=torch.int16, device="cuda:0")
    local_dst = torch.zeros_like(local_src)
    pairs = [
        (whole, far),
        (near[:, 32:64], far_shard),
        (near_shard, far[:, 32:64]),
        (local_dst, local_src),
    ]
    batch = CopyBatch.of(pairs)
    pushed = copy_kernel.available(torch.device("cuda", 1))
    assert len(batch.one_by_one) == (1 if pushed else 3)  # a strided source: torch's copy
    assert (batch.peer is not None) == pushed
    for _ in range(2):
        for t in (near, near_shard, whole, local_dst):
            t.zero_()
        batch.run()
        torch.cuda.synchronize(0)
        assert torch.equal(whole.cpu(), far.cpu())
        assert torch.equal(near[:, 32:64].cpu(), far_shard.cpu())
        assert not near[:, :32].any() and not near[:, 64:].any()
        assert torch.equal(near_shard.cpu(), far_shard.cpu())
        assert torch.equal(local_dst, local_src)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_peer_copies_land_strided_pieces_through_windows_bit_exact(monkeypatch):
    """Column shards from GPU 1 into their columns of whole tensors on GPU 0 cross through
    landing windows (made small here, so many windows reuse the two buffers), beside pieces
    whose destination is contiguous; pieces cut from one source buffer cross as runs. Every
    byte lands, nothing outside the boxes, on two runs of the same batch."""
    pytest.importorskip("cupy")
    from weightsync import peer_copies

    monkeypatch.setattr(peer_copies, "WINDOW_BYTES", 1 << 20)
    g = torch.Generator("cuda:1").manual_seed(3)
    flat = torch.empty(40 * 96 * 80, dtype=torch.int16, device="cuda:1").random_(generator=g)
    shards = flat.view(40, 96, 80)  # adjacent in source memory: one run per window
    odd = torch.empty(333, 7, dtype=torch.float32, device="cuda:1").random_(generator=g)
    wholes = torch.zeros(40, 96, 160, dtype=torch.int16, device="cuda:0")
    odd_whole = torch.zeros(333, 9, dtype=torch.float32, device="cuda:0")
    contiguous = torch.zeros(96, 80, dtype=torch.int16, device="cuda:0")
    pairs = [(wholes[e, :, 80:], shards[e]) for e in range(40)]
    pairs += [(odd_whole[:, 1:8], odd), (contiguous, shards[7])]
    batch = CopyBatch.of(pairs)
    assert batch.peer is not None and not batch.one_by_one
    for _ in range(2):
        for t in (wholes, odd_whole, contiguous):
            t.zero_()
        batch.run()
        torch.cuda.synchronize(0)
        assert torch.equal(wholes[:, :, 80:].cpu(), shards.cpu())
        assert not wholes[:, :, :80].any()
        assert torch.equal(odd_whole[:, 1:8].cpu(), odd.cpu())
        assert not odd_whole[:, 0].any() and not odd_whole[:, 8].any()
        assert torch.equal(contiguous.cpu(), shards[7].cpu())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fp8_experts_and_their_padded_scales_cross_as_one_run_and_land_exactly():
    """A bucket of FP8 experts on GPU 1: each weight, then its 384-byte scales, each entry at
    a 256-byte boundary. The padding between them crosses with the pieces (one copy per
    window, not one per piece) and lands nowhere: every parameter on GPU 0 gets its bytes,
    the padding's bytes (set apart here) reach none of them."""
    pytest.importorskip("cupy")
    experts, weight, scale = 24, 256 * 512, 384
    step = weight + 512
    bucket = torch.full((experts * step,), 0xEE, dtype=torch.uint8, device="cuda:1")
    g = torch.Generator("cuda:1").manual_seed(5)
    pairs, wants = [], []
    for e in range(experts):
        for at, nbytes, dtype in (
            (e * step, weight, torch.uint8),
            (e * step + weight, scale, torch.float32),
        ):
            src = bucket[at : at + nbytes]
            src.random_(0, 255, generator=g)  # never 0xEE
            src = src.view(dtype)
            dst = torch.zeros_like(src, device="cuda:0")
            pairs.append((dst, src))
            wants.append(src)
    batch = CopyBatch.of(pairs)
    assert batch.peer is not None
    (landing,) = batch.peer._landings
    assert [len(window) for window in landing.copies] == [1]
    batch.run()
    torch.cuda.synchronize(0)
    for (dst, _), want in zip(pairs, wants, strict=True):
        assert torch.equal(dst.cpu().view(torch.uint8), want.cpu().view(torch.uint8))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_peer_copies_wait_for_what_the_source_gpu_stream_writes_first():
    """A staged read from another GPU waits for its bucket's packed event on the source GPU's
    current stream (``BucketReader``), so the peer copies must queue after that stream too: the
    4 x H200 hosts bench read buckets before they were packed (wrong bytes every version). Here
    the source is written behind a long sleep on its GPU's stream; both a piece that crosses
    straight (>= 4 MiB) and one that lands through a window must see the new bytes."""
    pytest.importorskip("cupy")
    from weightsync import peer_copies

    big = torch.zeros(peer_copies.DIRECT_MIN_BYTES, dtype=torch.uint8, device="cuda:1")
    small = torch.zeros(4096, dtype=torch.uint8, device="cuda:1")
    big_dst = torch.zeros_like(big, device="cuda:0")
    small_dst = torch.zeros_like(small, device="cuda:0")
    batch = CopyBatch.of([(big_dst, big), (small_dst, small)])
    assert batch.peer is not None
    torch.cuda.synchronize(1)
    with torch.cuda.device(1):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time before the writes
        big.fill_(7)
        small.fill_(9)
    batch.run()
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert bool((big_dst == 7).all()) and bool((small_dst == 9).all())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_peer_copies_write_destinations_after_their_stream_and_reuse_windows_after_puts():
    """Crossings into landing windows wait only for the source; what writes a destination
    waits for its stream. GPU 0's stream sleeps, then sets the destinations: a piece put from
    a window and one crossing straight must both land after that. Then a batch of one window
    runs twice while its first put still waits behind a sleep: the second run's bytes must
    wait for that put to cross (a snapshot queued between the runs keeps the first's)."""
    pytest.importorskip("cupy")
    from weightsync import peer_copies

    big = torch.full((peer_copies.DIRECT_MIN_BYTES,), 3, dtype=torch.uint8, device="cuda:1")
    small = torch.full((64, 32), 4, dtype=torch.int16, device="cuda:1")
    big_dst = torch.zeros_like(big, device="cuda:0")
    wide = torch.zeros(64, 48, dtype=torch.int16, device="cuda:0")
    batch = CopyBatch.of([(big_dst, big), (wide[:, 16:], small)])
    assert batch.peer is not None and len(batch.peer._landings) == 1
    torch.cuda.synchronize(1)
    with torch.cuda.device(0):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time
        big_dst.fill_(1)
        wide.fill_(2)
    batch.run()
    torch.cuda.synchronize(0)
    assert bool((big_dst == 3).all())
    assert bool((wide[:, 16:] == 4).all()) and bool((wide[:, :16] == 2).all())

    solo = CopyBatch.of([(wide[:, 16:], small)])
    (landing,) = solo.peer._landings
    assert len(landing.copies) == 1
    snapshot = torch.empty_like(wide)
    with torch.cuda.device(0):
        torch.cuda._sleep(200_000_000)
    solo.run()
    with torch.cuda.device(0):
        snapshot.copy_(wide)
    torch.cuda.synchronize(1)  # the first run's bytes crossed; its put still waits
    small.fill_(5)
    solo.run()
    torch.cuda.synchronize(0)
    assert bool((snapshot[:, 16:] == 4).all())
    assert bool((wide[:, 16:] == 5).all())


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 GPUs")
def test_peer_copies_from_several_gpus_go_in_rounds_and_all_land():
    """GPU 0 reading from GPUs 1 and 2 takes them one after another (round ``0 ^ s``: GPU 1,
    then GPU 2), the second round queued behind the first on the GPUs; with GPU 1's bytes
    written behind a long sleep on its stream, every byte of both still lands, twice."""
    pytest.importorskip("cupy")
    from weightsync import peer_copies

    sources = {
        d: torch.zeros(peer_copies.DIRECT_MIN_BYTES, dtype=torch.uint8, device=d) for d in (1, 2)
    }
    small = {d: torch.zeros(4096, dtype=torch.uint8, device=d) for d in (1, 2)}
    dsts = {
        d: (torch.zeros_like(sources[d], device=0), torch.zeros_like(small[d], device=0))
        for d in (1, 2)
    }
    batch = CopyBatch.of(
        [pair for d in (2, 1) for pair in zip(dsts[d], (sources[d], small[d]), strict=True)]
    )
    assert batch.peer is not None
    assert batch.peer._rounds == [torch.device("cuda", 1), torch.device("cuda", 2)]
    for value in (5, 6):
        torch.cuda.synchronize(1)
        torch.cuda.synchronize(2)
        with torch.cuda.device(1):
            torch.cuda._sleep(200_000_000)
            sources[1].fill_(value)
            small[1].fill_(value + 10)
        with torch.cuda.device(2):
            sources[2].fill_(value + 20)
            small[2].fill_(value + 30)
        batch.run()
        torch.cuda.synchronize(0)
        assert bool((dsts[1][0] == value).all()) and bool((dsts[1][1] == value + 10).all())
        assert bool((dsts[2][0] == value + 20).all()) and bool((dsts[2][1] == value + 30).all())
