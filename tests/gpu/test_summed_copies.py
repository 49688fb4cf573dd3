"""The copies that take the bucket checksum on the way (``copy_sum``) give ``row_sums``'s value
and move every byte, packing a bucket and reading one, on awkward lengths and alignments."""

from __future__ import annotations

import pytest
import torch

from weightsync.checksum import finish, row_sums
from weightsync.summed_copies import CHUNK_BYTES, SummedCopies

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# (bytes, dtype, skew of the tensor outside the bucket): odd lengths, 8- but not 16-byte
# aligned ends, several table rows, and a bucket long enough for both kinds of checksum rows.
_TENSORS = [
    (6, torch.uint8, 0),
    (2 * 1001, torch.bfloat16, 8),
    (3 * CHUNK_BYTES + 40, torch.float32, 0),
    (8, torch.int64, 24),
    (70_002, torch.bfloat16, 16),
]


def _random(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator("cuda").manual_seed(seed)
    return torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 256, generator=g)


def _layout() -> tuple[list[tuple[int, int, torch.dtype, int]], int]:
    """(offset in the bucket, bytes, dtype, offset outside) per tensor, and the bucket size."""
    out, at, outside = [], 0, 0
    for n, dtype, skew in _TENSORS:
        outside += skew
        out.append((at, n, dtype, outside))
        at = -(-(at + n) // 256) * 256
        outside = -(-(outside + n) // 64) * 64
    return out, at


def _sums(buffer: torch.Tensor, nbytes: int, sums: torch.Tensor) -> tuple[int, int]:
    return finish(sums, nbytes), finish(row_sums(buffer, nbytes), nbytes)


def test_packing_a_bucket_sums_it_whole_stale_padding_included():
    pytest.importorskip("cupy")
    layout, nbytes = _layout()
    bucket = _random(nbytes + 512, seed=1)  # stale bytes from an earlier bucket
    outside = _random(nbytes + 4096, seed=2)
    pairs = [
        (bucket[at : at + n].view(dtype), outside[o : o + n].view(dtype))
        for at, n, dtype, o in layout
    ]
    copies = SummedCopies.plan(pairs, bucket, nbytes, destination=True)
    assert copies is not None
    for _ in range(2):  # built once, run every version
        got, want = _sums(bucket, nbytes, copies.run())
        torch.cuda.synchronize()
        assert got == want
    for dst, src in pairs:
        assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


def test_reading_a_bucket_sums_what_is_read_skipped_and_read_twice():
    pytest.importorskip("cupy")
    layout, nbytes = _layout()
    bucket = _random(nbytes, seed=3)
    params = torch.zeros(nbytes * 2 + 4096, dtype=torch.uint8, device="cuda")
    pairs = [
        (params[o : o + n].view(dtype), bucket[at : at + n].view(dtype))
        for i, (at, n, dtype, o) in enumerate(layout)
        if i != 2  # a tensor this rank does not keep
    ]
    at, n, dtype, _ = layout[4]
    pairs.append((params[nbytes + 512 : nbytes + 512 + n].view(dtype), pairs[-1][1]))
    copies = SummedCopies.plan(pairs, bucket, nbytes, destination=False)
    assert copies is not None
    got, want = _sums(bucket, nbytes, copies.run())
    torch.cuda.synchronize()
    assert got == want
    for dst, src in pairs:
        assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    bucket[at + n - 1] ^= 1  # the checksum sees a flipped bit in a tensor's tail word
    assert finish(copies.run(), nbytes) != got
