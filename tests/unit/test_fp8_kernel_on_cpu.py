"""The block FP8 kernel's own source, run on the CPU (``tests/support/cuda_on_cpu.py``) over
the tables ``fp8_kernel`` plans: one launch quantizes several weights (whole tiles held in
registers, edge tiles, a column slice with a pitch, a misaligned slice) into exactly the bytes
torch's ops make on CUDA, and writes nothing else (tests/gpu/test_fp8_gpu.py compares with
torch on the GPU itself)."""

from __future__ import annotations

import pytest
import torch

from tests.support import cuda_on_cpu
from weightsync import fp8_kernel
from weightsync.fp8 import FP8, BlockFp8, _ceil_to_power_of_two, scale_name, scale_shape

CANARY = 0xA5


@pytest.fixture(autouse=True)
def _compiler() -> None:
    assert cuda_on_cpu.compiler(), "these tests build the kernels with g++ and its libubsan"


def _as_torch_on_cuda(weight: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_block_fp8``'s ops with the one step whose bits differ between torch's CPU
    and CUDA kernels done as on CUDA: a tensor divided by a number is multiplied by the
    number's float32 reciprocal there (``div_true_kernel_cuda``), divided on the CPU."""
    rows, cols = weight.shape
    padded = weight.new_zeros((-(-rows // 128) * 128, -(-cols // 128) * 128))
    padded[:rows, :cols] = weight
    blocks = padded.view(-1, 128, padded.size(1) // 128, 128)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    scale = amax * (torch.tensor(1.0) / torch.tensor(448.0))
    if ue8m0:
        scale = _ceil_to_power_of_two(scale)
    values = (blocks * (1.0 / scale)).to(FP8)
    return values.view_as(padded)[:rows, :cols], scale.view(blocks.size(0), blocks.size(2))


def _every_bf16() -> torch.Tensor:
    """Every bf16 of magnitude 2^-20 to 2^8, both signs, and 448 (the block's amax): products
    that land on each of e4m3's rounding cases, its subnormals and exact ties included (with
    UE8M0 the scale is a power of two, so the products are exact)."""
    magnitudes = torch.arange(0x3580, 0x4380, dtype=torch.int32).to(torch.int16)
    values = torch.cat([magnitudes, magnitudes | -0x8000]).view(torch.bfloat16)
    tile = torch.zeros(128 * 128, dtype=torch.bfloat16)
    tile[: len(values)] = values
    tile[-1] = 448.0
    return tile.view(128, 128)


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)

    def wide(rows: int, cols: int) -> torch.Tensor:
        # Magnitudes over 2^-24 .. 2^4, so a tile's small values fall below e4m3's normals.
        exponent = torch.randint(-24, 4, (rows, cols), generator=g).float()
        return (torch.randn(rows, cols, generator=g) * 2**exponent).bfloat16()

    whole = wide(256, 384)
    whole[0, 0] = 3.0e4
    whole[128:, 128:256] = 0.0  # a tile of zeros: the amax floor
    big = wide(256, 512)
    return {
        "whole": whole,
        "ragged": wide(300, 200),
        "one_row": wide(1, 7),
        "columns": big[:, 128:384],  # a TP shard's columns: pitch 1024 bytes, whole tiles
        "misaligned": big[:128, 1:129],  # 2 bytes off 16: an aligned-looking tile, by elements
        "every_bf16": _every_bf16(),
    }


@pytest.mark.parametrize("ue8m0", [False, True])
def test_one_launch_quantizes_every_weight_as_torch_on_cuda_and_writes_nothing_else(ue8m0):
    weights = _weights()
    values = {n: torch.full((w.shape[0], w.shape[1] + 8), CANARY, dtype=torch.uint8)
              for n, w in weights.items()}  # fmt: skip
    scales = {n: torch.full(scale_shape(w.shape), float("nan")) for n, w in weights.items()}
    jobs = [(w, values[n][:, : w.shape[1]].view(FP8), scales[n]) for n, w in weights.items()]
    table = torch.from_numpy(fp8_kernel.table(jobs))
    cuda_on_cpu.launch(
        "quantize_fp8", fp8_kernel.tiles(jobs), table.data_ptr(), len(jobs), int(ue8m0)
    )
    for name, w in weights.items():
        want_values, want_scales = _as_torch_on_cuda(w, ue8m0)
        got = values[name]
        assert torch.equal(got[:, : w.shape[1]], want_values.view(torch.uint8)), name
        assert torch.equal(scales[name], want_scales), name
        assert bool((got[:, w.shape[1] :] == CANARY).all()), f"{name}: wrote past its columns"


def test_the_table_numbers_tiles_across_tensors_in_order():
    a, b = torch.zeros(300, 200, dtype=torch.bfloat16), torch.zeros(128, 128, dtype=torch.bfloat16)
    jobs = [(a, a.view(torch.uint8)[:, :200], torch.zeros(3, 2)),
            (b, b.view(torch.uint8)[:, :128], torch.zeros(1, 1))]  # fmt: skip
    table = fp8_kernel.table(jobs)
    assert table[:, 7].tolist() == [0, 6]
    assert table[:, 1].tolist() == [400, 256]  # source pitches in bytes
    assert table[:, 2:4].tolist() == [[300, 200], [128, 128]]
    assert fp8_kernel.tiles(jobs) == 7


def test_the_kernel_takes_only_what_it_can_write_within_bounds(monkeypatch):
    """``fits`` refuses (so ``BlockFp8`` takes torch's ops) anything but a bf16 matrix with
    e4m3 values of its shape and float32 scales of its tiles; and a CPU tensor, where the
    kernel does not launch."""
    w = torch.zeros(300, 200, dtype=torch.bfloat16)
    values, scales = torch.zeros(300, 200, dtype=FP8), torch.zeros(3, 2)
    assert not fp8_kernel.fits(w, values, scales)  # on the CPU
    monkeypatch.setattr(fp8_kernel.copy_kernel, "available", lambda device: True)
    assert fp8_kernel.fits(w, values, scales)
    assert not fp8_kernel.fits(w.float(), values, scales)
    assert not fp8_kernel.fits(w, values[:, :100], scales)
    assert not fp8_kernel.fits(w, values.view(torch.uint8), scales)
    assert not fp8_kernel.fits(w, values, torch.zeros(2, 2))
    assert not fp8_kernel.fits(w, values, torch.zeros(2, 3).t())
    assert not fp8_kernel.fits(w.t(), values.t(), scales.t())  # columns not contiguous


def test_block_fp8s_own_buffers_are_what_the_kernel_takes(monkeypatch):
    """The values and scales ``BlockFp8`` allocates pass ``fits`` (so on a GPU its bf16
    weights go through the kernel, as tests/gpu/test_fp8_gpu.py asserts there)."""
    weights = {
        "q_proj.weight": torch.zeros(300, 200, dtype=torch.bfloat16),
        "up_proj.weight": torch.zeros(512, 256, dtype=torch.bfloat16)[:, 128:],
    }
    out = BlockFp8()(weights)
    monkeypatch.setattr(fp8_kernel.copy_kernel, "available", lambda device: True)
    for name, w in weights.items():
        assert fp8_kernel.fits(w, out[name], out[scale_name(name)]), name
