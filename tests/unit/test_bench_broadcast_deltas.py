"""The NCCL deltas bench's trainer off the GPU (the measurement runs on 2+ GPUs:
``python -m weightsync.app.bench.broadcast_deltas --gpus N``)."""

from __future__ import annotations

import torch

from weightsync.app.bench.broadcast_deltas_gpu import _trainer, gpu_chain
from weightsync.app.bench.models import hf_specs, model_shape


def test_every_version_is_published_from_the_same_trainer_memory_and_equals_its_chain_link():
    """As a trainer's: one buffer, updated in place; the views the publisher offers never
    move, and after each copy they hold that version's tensors bit for bit."""
    specs = hf_specs(model_shape("tiny", 1))
    chain, views = gpu_chain(specs, 2, None, torch.device("cpu"))
    live, tensors = _trainer(chain, specs)
    addresses = {n: t.data_ptr() for n, t in tensors.items()}
    assert list(tensors) == list(views[0]) and live.data_ptr() not in {c.data_ptr() for c in chain}
    for flat, version in zip(chain, views, strict=True):
        live.copy_(flat)
        assert {n: t.data_ptr() for n, t in tensors.items()} == addresses
        for name, t in version.items():
            got = tensors[name]
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name
    assert not torch.equal(chain[0], chain[1])  # the versions differ: the copies matter
