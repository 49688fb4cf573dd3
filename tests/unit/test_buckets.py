"""Plan -> pack -> unpack round-trips bit-exactly for any tensors and any cap."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.buckets import (
    ALIGNMENT_BYTES,
    ChunkAssembler,
    TensorSpec,
    byte_view,
    pack_entry,
    plan_buckets,
    unpack_bucket,
)
from weightsync.errors import ConfigError, PlanError

DTYPES = [torch.bfloat16, torch.float32, torch.int64, torch.float16, torch.int8, torch.bool]


@st.composite
def tensors(draw):
    n = draw(st.integers(0, 8))
    out = []
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 40), min_size=0, max_size=3)))
        numel = math.prod(shape)
        raw = torch.randint(
            0,
            256,
            (numel * torch.empty((), dtype=dtype).element_size(),),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(i),
        )
        if dtype == torch.bool:
            raw = raw % 2  # a bool byte other than 0/1 is not a valid bool
        # Random bytes, so NaN payloads and signed zeros must survive too.
        t = raw.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)
        out.append((f"t{i}.{str(dtype)[6:]}", t))
    return out


def round_trip(named, cap):
    plan = plan_buckets([TensorSpec.of(n, t) for n, t in named], cap)
    by_name = dict(named)
    got = {}
    assembler = ChunkAssembler()
    buffer = torch.zeros(cap, dtype=torch.uint8)
    for bucket in plan.buckets:
        assert bucket.nbytes <= cap
        buffer.fill_(0xAB)  # the reused buffer holds garbage from before
        for entry in bucket.entries:
            assert entry.offset % ALIGNMENT_BYTES == 0
            pack_entry(buffer, entry, by_name[entry.name])
        for name, t in unpack_bucket(buffer, bucket, assembler):
            got[name] = t.clone()
    assert assembler.pending == []
    return plan, got


@settings(max_examples=200, deadline=None)
@given(named=tensors(), cap_rows=st.integers(1, 64))
def test_round_trip_is_bit_exact_for_any_cap(named, cap_rows):
    cap = cap_rows * ALIGNMENT_BYTES
    plan, got = round_trip(named, cap)
    assert set(got) == {n for n, _ in named}
    for name, t in named:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(byte_view(got[name].contiguous()), byte_view(t.contiguous()))


def test_order_is_deterministic_and_follows_the_manifest():
    specs = [TensorSpec(f"w{i}", "float32", (i + 1, 16)) for i in range(10)]
    a, b = plan_buckets(specs, 1024), plan_buckets(specs, 1024)
    assert a == b
    names = [e.name for bucket in a.buckets for e in bucket.entries]
    assert names == [s.name for s in specs]


def test_large_tensor_is_chunked_on_row_boundaries():
    spec = TensorSpec("embed", "bfloat16", (100, 64))  # 128-byte rows, 12800 bytes
    plan = plan_buckets([spec], 1024)
    chunks = [e for b in plan.buckets for e in b.entries]
    assert len(chunks) == 13 and all(c.num_chunks == 13 for c in chunks)
    assert all(c.tensor_offset % spec.row_bytes == 0 for c in chunks)
    assert sum(c.nbytes for c in chunks) == spec.nbytes


def test_rows_larger_than_the_cap_split_on_bytes():
    spec = TensorSpec("wide", "float32", (2, 1000))  # 4000-byte rows, cap 1024
    _, got = round_trip([("wide", torch.arange(2000, dtype=torch.float32).reshape(2, 1000))], 1024)
    assert torch.equal(got["wide"], torch.arange(2000, dtype=torch.float32).reshape(2, 1000))
    assert spec.row_bytes > 1024


def test_dtype_and_scalars_are_preserved():
    named = [
        ("router", torch.tensor(1.5, dtype=torch.float32)),
        ("bias", torch.tensor([1, 2], dtype=torch.int64)),
        ("w", torch.ones(3, 3, dtype=torch.bfloat16)),
    ]
    _, got = round_trip(named, 4096)
    assert got["router"].dtype == torch.float32 and got["router"].shape == ()
    assert got["bias"].dtype == torch.int64


def test_bad_cap_and_duplicate_names_are_errors():
    with pytest.raises(ConfigError, match="multiple of 256"):
        plan_buckets([], 1000)
    with pytest.raises(PlanError, match="'a' appears twice"):
        plan_buckets([TensorSpec("a", "float32", (1,)), TensorSpec("a", "float32", (1,))], 1024)


def test_pack_rejects_a_tensor_that_differs_from_its_spec():
    plan = plan_buckets([TensorSpec("w", "float32", (4,))], 1024)
    with pytest.raises(PlanError, match="'w' is \\(5,\\) float32 but the manifest says \\(4,\\)"):
        pack_entry(torch.zeros(1024, dtype=torch.uint8), plan.buckets[0].entries[0], torch.zeros(5))
