"""Block FP8 of many bf16 weights in one launch, on CUDA where CuPy is (:mod:`.copy_kernel`
compiles it). A CUDA block per 128 x 128 tile reads the tile once and writes its e4m3 values
and its scale: one read of the weights and one write of the result, where torch's ops
(:func:`.fp8.quantize_block_fp8`) take about eight passes. The bytes are theirs on CUDA, bit
for bit (tests/gpu/test_fp8_gpu.py; tests/unit/test_fp8_kernel_on_cpu.py runs the source on
the CPU). The source: :mod:`.fp8_kernel_source`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from weightsync import copy_kernel

TILE = 128
"""The kernel's block edge (the engines' ``weight_block_size`` of [128, 128])."""

Job = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(weight, its e4m3 values, its float32 scales)."""


def fits(weight: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether the kernel can quantize ``weight`` into ``values`` and ``scales``: a bf16
    matrix on a GPU where the kernel runs, e4m3 values of its shape, float32 scales of its
    grid of tiles (contiguous), rows of contiguous elements, all on one device."""
    return (
        copy_kernel.available(weight.device)
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.numel() > 0
        and weight.stride(1) == 1
        and values.dtype == torch.float8_e4m3fn
        and values.shape == weight.shape
        and values.stride(1) == 1
        and scales.dtype == torch.float32
        and tuple(scales.shape) == grid(weight.shape)
        and scales.is_contiguous()
        and values.device == weight.device == scales.device
    )


def grid(shape: Sequence[int]) -> tuple[int, ...]:
    """The tiles of a matrix of ``shape`` along each dim (its scales' shape)."""
    return tuple(-(-n // TILE) for n in shape)


def table(jobs: Sequence[Job]) -> np.ndarray:
    """The kernel's table, a row per job: (source, source pitch, rows, columns, values,
    values pitch, scales, first tile), pitches in bytes; int64 (the kernel reads uint64)."""
    rows = []
    first = 0
    for weight, values, scales in jobs:
        r, c = weight.shape
        rows.append(
            (
                weight.data_ptr(),
                weight.stride(0) * weight.element_size(),
                r,
                c,
                values.data_ptr(),
                values.stride(0) * values.element_size(),
                scales.data_ptr(),
                first,
            )
        )
        first += math.prod(grid(weight.shape))
    return np.array(rows, dtype=np.int64).reshape(-1, 8)


def tiles(jobs: Sequence[Job]) -> int:
    """The blocks a launch of ``jobs`` takes: every tile of every weight."""
    return sum(math.prod(grid(w.shape)) for w, _, _ in jobs)


class Quantize:
    """``jobs`` (each :func:`fits`, on one GPU) as one launch: build once, :meth:`run` every
    version. The table holds addresses, not the tensors: run it only while tensors of the same
    shapes and strides are at them (the caller keys it by them)."""

    def __init__(self, jobs: Sequence[Job], *, ue8m0: bool = False) -> None:
        self.device = jobs[0][0].device
        self.count = len(jobs)
        self.ue8m0 = ue8m0
        self.tiles = tiles(jobs)
        self._table = torch.from_numpy(table(jobs)).view(-1).to(self.device)

    def run(self) -> None:
        copy_kernel.launch(
            "quantize_fp8",
            self.device,
            self.tiles,
            self._table.data_ptr(),
            self.count,
            int(self.ue8m0),
        )
