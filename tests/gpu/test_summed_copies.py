"""The copies that take the bucket checksum on the way (``copy_sum``) give ``row_sums``'s value
and move every byte, packing a bucket and reading one (cases in
``tests/support/kernel_cases.py``; the CPU runs the same source in
``tests/unit/test_copy_kernels_on_cpu.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.support import kernel_cases
from weightsync.checksum import finish, finish_all, row_sums
from weightsync.regions import _BITS, CopyBatch
from weightsync.summed_copies import SummedCopies

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@kernel_cases.SUMMED
def test_copies_sum_the_whole_bucket_once_and_move_every_byte(make, destination):
    pytest.importorskip("cupy")
    case = make("cuda")
    copies = SummedCopies.plan(case.pairs, case.bucket, case.nbytes, destination=destination)
    assert copies is not None
    for _ in range(2):  # built once, run every version
        got = finish(copies.run(), case.nbytes)
        assert got == finish(row_sums(case.bucket, case.nbytes), case.nbytes)
    torch.cuda.synchronize()
    assert kernel_cases.moved(case)
    if not destination:
        case.bucket[case.flip] ^= 1  # a flipped bit in a tensor's last, partial word
        assert finish(copies.run(), case.nbytes) != got


@pytest.mark.parametrize(
    "make", [kernel_cases.packing, kernel_cases.columns], ids=["whole", "columns"]
)
def test_a_pack_writes_a_receivers_weights_in_the_same_launch(make):
    pytest.importorskip("cupy")
    case = make("cuda")
    moves, weights = kernel_cases.weights_of(case)
    pack = SummedCopies.plan(case.pairs, case.bucket, case.nbytes, destination=True)
    assert pack is not None
    fused = pack.also(moves)
    assert fused is not None
    got = finish(fused.run(), case.nbytes)
    assert got == finish(row_sums(case.bucket, case.nbytes), case.nbytes)
    torch.cuda.synchronize()
    assert kernel_cases.moved(case)
    assert kernel_cases.written(case, moves, weights)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_reads_from_a_bucket_on_another_gpu_are_checked_where_they_landed():
    """A receiver on GPU 0 reading a bucket on GPU 1: the peer copies (one crossing straight,
    small and strided ones through a landing window) are summed where they landed, so a copy
    that did not land fails the checksum. A second read of the bucket, what receivers did
    before, passed 4 x H200 versions whose copies read the bucket before it was packed."""
    pytest.importorskip("cupy")
    from weightsync import peer_copies, summed_copies

    nbytes = peer_copies.DIRECT_MIN_BYTES + (1 << 20)
    g = torch.Generator().manual_seed(9)
    bucket = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).to("cuda:1")
    big, rest = bucket[: peer_copies.DIRECT_MIN_BYTES], bucket[peer_copies.DIRECT_MIN_BYTES :]
    whole = torch.zeros(64, 256, dtype=torch.bfloat16, device="cuda:0")
    pairs = [
        (torch.zeros_like(big, device="cuda:0"), big),
        (torch.zeros(4000, dtype=torch.uint8, device="cuda:0"), rest[:4000]),  # not whole words
        (whole[:, :128], rest[4096 : 4096 + 64 * 256].view(torch.bfloat16).view(64, 128)),
    ]  # the rest of the bucket is a tensor this rank does not keep
    copies = summed_copies.copies(pairs, bucket, nbytes, destination=False)
    assert isinstance(copies, summed_copies.LandedSums)
    want = finish(row_sums(bucket, nbytes), nbytes)
    for _ in range(2):  # built once, run every version
        assert finish_all([copies.run()], [nbytes]) == [want]
    torch.cuda.synchronize(0)
    assert all(torch.equal(_bits(d).cpu(), _bits(s).cpu()) for d, s in pairs)  # NaNs as bits
    for missed in range(len(pairs)):
        pairs[missed][0].zero_()
        copies.batch = CopyBatch.of(pairs[:missed] + pairs[missed + 1 :])
        assert finish_all([copies.run()], [nbytes]) != [want], f"copy {missed} did not land"
