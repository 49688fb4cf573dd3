"""The delta scan kernel's own source, run on the CPU (``tests/support/cuda_on_cpu.py``): one
launch reads two versions of a bucket and adds up what torch's whole-bucket masks count
(``delta_scan._counted``): the changed elements of each size, the changed 32-bit words, the
consecutive changed words 1 .. GAP_WORDS + 1 apart, and both versions' checksum sums, equal
number for number, whatever the blocks and their strides (tests/gpu/test_deltas_gpu.py runs it
on a GPU inside the encoder, against the CPU's deltas)."""

from __future__ import annotations

import pytest
import torch

from tests.support import cuda_on_cpu
from tests.unit.test_deltas import _patterned
from weightsync import delta_kernel_source, delta_scan
from weightsync.checksum import whole_row_words


@pytest.fixture(autouse=True)
def _compiler() -> None:
    assert cuda_on_cpu.compiler(), "these tests build the kernels with g++ and its libubsan"


def _grid(n: int, blocks: int) -> tuple[int, int]:
    """``blocks`` contiguous chunks of the 16-byte pairs of ``n`` bytes (as ``_Grid.of``)."""
    chunk = -(-(n // 16) // blocks)
    return -(-(n // 16) // chunk), chunk


def _scan(old: torch.Tensor, cur: torch.Tensor, unit: int, blocks: int) -> list[int]:
    return _launch_scan(old, cur, unit, blocks)[0]


def _launch_scan(old: torch.Tensor, cur: torch.Tensor, unit: int, blocks: int):
    out = torch.zeros(delta_kernel_source.SCAN_VALUES, dtype=torch.int64)
    n = old.numel()
    blocks, chunk = _grid(n, blocks)
    counts = torch.full((blocks,), -1, dtype=torch.int64)
    cuda_on_cpu.launch(
        "delta_scan", blocks, old.data_ptr(), cur.data_ptr(), n // 8, whole_row_words(n), unit,
        out.data_ptr(), chunk, counts.data_ptr(),
    )  # fmt: skip
    return out.tolist(), counts, blocks, chunk


@pytest.mark.parametrize("pattern", ["none", "scattered", "gaps", "clustered", "all"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("nbytes", "blocks"),
    [(256 * 37, 1), ((128 << 10) + 768, 3)],  # tail rows only; two whole rows, a tail, strides
)
def test_one_launch_counts_and_sums_what_the_masks_do(pattern, dtype, nbytes, blocks):
    previous, new = (t.view(torch.uint8) for t in _patterned(pattern, dtype, nbytes))
    unit = dtype.itemsize
    words = previous.view(torch.int32) != new.view(torch.int32)
    element = previous.view(delta_scan.UNITS[unit]) != new.view(delta_scan.UNITS[unit])
    assert _scan(previous, new, unit, blocks) == delta_scan._counted(previous, new, words, element)


def test_a_changed_word_next_to_the_bucket_end_counts_no_neighbour_past_it():
    previous = torch.zeros(256, dtype=torch.uint8)
    new = previous.clone()
    new[-4:] = 1  # the last word alone: one changed, no pair
    new[-16] = 1  # three words before it: a pair 3 apart
    got = _scan(previous, new, 1, 1)
    assert got[:2] == [5, 2] and got[2 : 2 + delta_kernel_source.NEAR] == [0, 0, 1]


def test_the_kernel_joins_runs_as_far_apart_as_the_codec_does():
    assert delta_kernel_source.NEAR == delta_scan.GAP_WORDS + 1


@pytest.mark.parametrize("pattern", ["none", "scattered", "clustered", "all"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("nbytes", "blocks"),
    # one block, a part of a tile; three blocks of two whole tiles and a part each
    [(256 * 37, 1), ((128 << 10) + 768, 3)],
)
def test_the_indices_kernel_writes_what_nonzero_and_a_gather_give(pattern, dtype, nbytes, blocks):
    previous, new = (t.view(torch.uint8) for t in _patterned(pattern, dtype, nbytes))
    unit = dtype.itemsize
    view = delta_scan.UNITS[unit]
    numbers, counts, blocks, chunk = _launch_scan(previous, new, unit, blocks)
    picked = torch.nonzero(previous.view(view) != new.view(view)).flatten()
    assert int(counts.sum()) == numbers[0] == picked.numel()  # each block's count, no other
    idx = torch.full((picked.numel(),), -1, dtype=torch.int32)
    values = torch.zeros(picked.numel(), dtype=view)
    offsets = torch.cumsum(counts, 0) - counts
    cuda_on_cpu.launch(
        "delta_indices", blocks, previous.data_ptr(), new.data_ptr(), nbytes // 8, unit, chunk,
        offsets.data_ptr(), idx.data_ptr(), values.data_ptr(),
    )  # fmt: skip
    assert torch.equal(idx, picked.to(torch.int32))
    assert torch.equal(values, new.view(view)[picked])
