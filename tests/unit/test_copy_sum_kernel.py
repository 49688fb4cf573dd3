"""The ``copy_sum`` kernel's own CUDA source, run on the CPU (``tests/support/cuda_on_cpu.py``)
over the tables ``summed_copies`` plans: it moves every byte and gives ``row_sums``'s value,
packing a bucket and reading one (the GPU runs the same cases in tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from tests.support import cuda_on_cpu, summed
from weightsync import copy_kernel
from weightsync.checksum import finish, row_sums, whole_row_words
from weightsync.summed_copies import plan_rows, table

pytestmark = pytest.mark.skipif(cuda_on_cpu.compiler() is None, reason="needs g++")


def _run(case: summed.Case, destination: bool) -> int:
    rows = plan_rows(
        [(s.data_ptr(), d.data_ptr(), d.nbytes) for d, s in case.pairs],
        base=case.bucket.data_ptr(),
        nbytes=case.nbytes,
        destination=destination,
    )
    assert rows is not None
    rows_table = table(rows)
    out = torch.zeros(2, dtype=torch.int64)
    cuda_on_cpu.kernels().launch_copy_sum(
        len(rows), copy_kernel.THREADS, rows_table.data_ptr(), whole_row_words(case.nbytes),
        out.data_ptr(),
    )  # fmt: skip
    return finish(out, case.nbytes)


@pytest.mark.parametrize("destination", [True, False], ids=["packing", "reading"])
def test_the_kernel_sums_the_whole_bucket_once_and_moves_every_byte(destination):
    case = (summed.packing if destination else summed.reading)("cpu")
    got = _run(case, destination)
    assert summed.moved(case)
    assert got == finish(row_sums(case.bucket, case.nbytes), case.nbytes)
    # Reading: a bit of a tensor's last word. Packing: of the padding in that word, which the
    # pack leaves as it was (and the receivers' reads sum, so the sender must too).
    case.bucket[case.flip + destination] ^= 1
    flipped = _run(case, destination)
    assert flipped != got
    assert flipped == finish(row_sums(case.bucket, case.nbytes), case.nbytes)
