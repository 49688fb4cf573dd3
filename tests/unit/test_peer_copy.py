"""Which copies are pulled from another GPU on the destination's stream: the contiguous ones
between two GPUs (checked on CPU tensors, where none is)."""

from __future__ import annotations

import torch

from weightsync import peer_copy


def test_nothing_on_cpu_is_pulled():
    assert not peer_copy.can_pull(torch.zeros(6), torch.arange(6.0))
