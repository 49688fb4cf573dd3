"""The order a reader takes its peer GPUs in (:func:`weightsync.peer_copies.rounds`): pure, so
it runs here; the copies it orders run in tests/gpu and `weightsync bench --gpus 4`."""

from __future__ import annotations

import pytest
import torch

from weightsync.peer_copies import rounds


def cuda(i: int) -> torch.device:
    return torch.device("cuda", i)


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_every_gpu_reading_from_every_other_pairs_up_in_each_round(gpus):
    order = {d: rounds([cuda(s) for s in range(gpus) if s != d], [cuda(d)]) for d in range(gpus)}
    for k in range(gpus - 1):
        partner = {d: order[d][k].index for d in range(gpus)}
        # A perfect matching: d reads from p exactly when p reads from d.
        assert all(partner[partner[d]] == d != partner[d] for d in range(gpus)), (k, partner)


def test_one_source_and_unequal_sets_keep_every_source_once():
    assert rounds([cuda(3)], [cuda(0)]) == [cuda(3)]
    got = rounds([cuda(5), cuda(1), cuda(2)], [cuda(6), cuda(4)])
    assert got == [cuda(5), cuda(1), cuda(2)]  # by s ^ 4: 1, 5, 6
