"""``DEVICES``: parametrize a test over the CPU (CI) and CUDA (marked ``gpu``: run on the
lent GPU machine, docs/gpu.md)."""

import pytest
import torch

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]
