"""Which copies are pulled from another GPU on the destination's stream: the contiguous ones
(checked on CPU tensors, where none is)."""

from __future__ import annotations

import torch

from weightsync import peer_copy


def test_nothing_on_cpu_is_pulled_and_pull_falls_back_to_torchs_copy():
    src, dst = torch.arange(6.0), torch.zeros(6)
    assert not peer_copy.can_pull(dst, src)
    peer_copy.pull(dst, src)
    assert torch.equal(dst, src)
