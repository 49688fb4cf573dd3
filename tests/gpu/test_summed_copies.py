"""The copies that take the bucket checksum on the way (``copy_sum``) give ``row_sums``'s value
and move every byte, packing a bucket and reading one (cases in
``tests/support/kernel_cases.py``; the CPU runs the same source in
``tests/unit/test_copy_kernels_on_cpu.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.support import kernel_cases
from weightsync.checksum import finish, row_sums
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
