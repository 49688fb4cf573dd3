"""Exact deltas on a GPU (issue 36): the CUDA scan (``delta_scan.dense``: whole-bucket masks,
one sync) makes the same delta as the CPU's, part for part, on every element size, odd sizes
and every kind of change; CUDA decoding gives back the new bytes bit for bit, through the wire
form too; a wrong base is refused before any write.

Run on a GPU machine: ``python -m pytest -m gpu tests/gpu/test_deltas_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_deltas import _patterned
from weightsync.delta_wire import from_wire, to_wire
from weightsync.deltas import decode, encode
from weightsync.errors import WrongBaseError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("pattern", ["none", "scattered", "gaps", "clustered", "all"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nbytes", [256, 256 * 37, 64 << 20])
def test_the_cuda_delta_is_the_cpu_delta_and_decodes_bit_for_bit(pattern, dtype, nbytes):
    previous, new = _patterned(pattern, dtype, nbytes)
    on_cpu = encode(previous, new, base_version=3, bucket="b")
    on_gpu = encode(previous.cuda(), new.cuda(), base_version=3, bucket="b")
    assert (on_gpu.kind, on_gpu.base_checksum, on_gpu.checksum) == (
        on_cpu.kind,
        on_cpu.base_checksum,
        on_cpu.checksum,
    )
    for a, b in zip(on_cpu.parts, on_gpu.parts, strict=True):
        assert b.is_cuda and torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))
    back = on_gpu
    if on_gpu.kind != "full":  # a full bucket travels as itself, not as a delta
        msg, payload = to_wire(on_gpu)
        back = from_wire(msg, payload, nbytes, "bucket 0 of version 4")
    held = previous.cuda()
    decode(back, held, base_version=3, base_checksum=on_gpu.base_checksum)
    assert torch.equal(held.view(torch.uint8), new.cuda().view(torch.uint8))


def test_a_cuda_delta_onto_other_bytes_is_refused_before_any_write():
    previous, new = (t.cuda() for t in _patterned("scattered", torch.bfloat16, 1 << 20))
    delta = encode(previous, new, base_version=5, bucket="version 6, bucket 1")
    held = new.clone()  # not the base
    with pytest.raises(WrongBaseError, match="version 6, bucket 1"):
        decode(delta, held, base_version=5)
    assert torch.equal(held.view(torch.uint8), new.view(torch.uint8))
