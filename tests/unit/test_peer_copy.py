"""Which views a pull from another GPU can copy: rows of contiguous bytes at a fixed pitch
(pure stride arithmetic, checked on CPU tensors)."""

from __future__ import annotations

import pytest
import torch

from weightsync.peer_copy import _rows, can_pull, pitched

W = torch.zeros(6, 8, 10, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("view", "want"),
    [
        (W, (1, 960, 960)),  # contiguous: one row of every byte
        (W[2:4], (1, 320, 320)),  # whole rows of dim 0: still contiguous
        (W[:, :, 3:7], (48, 8, 20)),  # a box of the last dim: 48 rows of 4 elements
        (W[1:3, 2:5], (2, 60, 160)),  # rows 2-4 of two matrices: 60 bytes, 160 apart
        (W.view(48, 10)[:, 5:], (48, 10, 20)),  # a column shard of a row-parallel weight
        (W[0, 0, 0], (1, 2, 2)),  # one element
        (W.view(480)[::2], (240, 2, 4)),  # every other element: rows of one element
    ],
    ids=["whole", "leading rows", "last-dim box", "two matrices", "column shard", "one", "step"],
)
def test_pitched_views(view, want):
    assert pitched(view) == want


def test_overlapping_rows_and_boxes_of_three_strides_are_not_pitched():
    assert pitched(torch.zeros(1, 4).expand(3, 4)) is None  # every row the same memory
    assert pitched(W[:, 2:5, 3:7]) is None


def test_nothing_on_cpu_is_pulled():
    assert not can_pull(torch.zeros(4), torch.zeros(4))


def test_a_contiguous_side_takes_the_other_sides_rows():
    shard = torch.zeros(48, 5, dtype=torch.bfloat16)
    column = W.view(48, 10)[:, 5:]
    assert _rows(column, shard) == (48, 10, 20, 10)
    assert _rows(shard, column) == (48, 10, 10, 20)
    assert _rows(W.view(48, 10)[:, :4], shard[:, :4].t().contiguous().t()) is None
