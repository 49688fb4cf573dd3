"""Exact deltas between versions of one bucket (issue 36, ``weightsync.deltas``): decoding gives
back the new bytes bit for bit at every sparsity, NaN payloads and signed zeros included; the
smallest form is chosen; a delta never applies onto other bytes than it was made from."""

from __future__ import annotations

import pytest
import torch

from weightsync.deltas import GAP_WORDS, Delta, checksum_of, decode, encode, sizes
from weightsync.errors import ChecksumError, ConfigError, WrongBaseError

ELEMENTS = 1 << 16  # a 128 KiB bf16 bucket


def _bucket(seed: int, n: int = ELEMENTS) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).bfloat16()


def _changed(previous: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """``previous`` with ``fraction`` of its elements moved by one bf16 step, at random."""
    g = torch.Generator().manual_seed(seed)
    new = previous.clone()
    picked = torch.randperm(previous.numel(), generator=g)[: round(fraction * previous.numel())]
    new.view(torch.int16)[picked] += 1
    return new


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fraction", [0.0, 1e-4, 0.01, 0.05, 0.2, 0.5, 1.0])
def test_decoding_gives_back_the_new_bytes_at_every_sparsity(fraction):
    previous = _bucket(1)
    new = _changed(previous, fraction, seed=2)
    delta = encode(previous, new, base_version=4, bucket="version 5, bucket 0")
    held = previous.clone()
    assert decode(delta, held, base_version=4) is held
    assert _same_bits(held, new)
    assert delta.payload_bytes <= new.nbytes
    changed = round(fraction * ELEMENTS)
    if fraction <= 0.05:  # scattered: 6 bytes per changed bf16 value
        assert (delta.kind, delta.payload_bytes) == ("indices", changed * 6)
    if fraction == 1.0:  # every value moved: 2 bytes each beat 6, and every word changed
        assert delta.kind == "full"


def test_nan_payloads_and_signed_zeros_travel_exactly():
    at = [0, 20, 40, 60]  # apart: the index form
    previous = _bucket(3, 256)
    previous.view(torch.int16)[at] = torch.tensor([0x7FC0, 0x7FC1, 0, -0x8000], dtype=torch.int16)
    new = previous.clone()
    new.view(torch.int16)[at] = torch.tensor([0x7FC1, 0x7FC0, -0x8000, 0], dtype=torch.int16)
    for changed in (at, []):  # and a NaN left as it is is no change
        want = previous.clone() if not changed else new
        delta = encode(previous, want, base_version=1, bucket="bucket nan")
        assert delta.kind == "indices" and delta.parts[0].tolist() == changed
        held = previous.clone()
        decode(delta, held, base_version=1)
        assert _same_bits(held, want)


def test_an_empty_delta_carries_nothing_and_leaves_the_bytes():
    previous = _bucket(4)
    delta = encode(previous, previous.clone(), base_version=2, bucket="bucket same")
    assert (delta.kind, delta.payload_bytes) == ("indices", 0)
    held = previous.clone()
    decode(delta, held, base_version=2)
    assert _same_bits(held, previous)


def test_all_changed_travels_full_and_applies_onto_any_bytes():
    previous = _bucket(5)
    new = _bucket(6)
    delta = encode(previous, new, base_version=8, bucket="bucket all")
    assert (delta.kind, delta.payload_bytes) == ("full", new.nbytes)
    elsewhere = torch.zeros_like(previous)  # a receiver that missed versions
    decode(delta, elsewhere, base_version=3)
    assert _same_bits(elsewhere, new)


def test_bytes_passed_as_uint8_compare_in_the_given_element_size():
    previous = _bucket(7)
    new = _changed(previous, 0.01, seed=8)
    as_bytes = encode(
        previous.view(torch.uint8),
        new.view(torch.uint8),
        base_version=1,
        bucket="b",
        element_bytes=2,
    )
    assert as_bytes.payload_bytes == encode(previous, new, base_version=1, bucket="b").payload_bytes
    held = previous.clone().view(torch.uint8)
    decode(as_bytes, held, base_version=1)
    assert _same_bits(held, new)


@pytest.mark.parametrize("wrong", ["version", "bytes"])
def test_a_delta_onto_another_base_is_refused_naming_the_bucket_before_any_write(wrong):
    previous = _bucket(9)
    new = _changed(previous, 0.01, seed=10)
    delta = encode(previous, new, base_version=6, bucket="version 7, bucket 2")
    held = previous.clone() if wrong == "version" else _changed(previous, 1e-4, seed=11)
    before = held.clone()
    version = 5 if wrong == "version" else 6
    with pytest.raises(WrongBaseError, match=r"^version 7, bucket 2: .*full bytes"):
        decode(delta, held, base_version=version)
    assert _same_bits(held, before)
    # The checksum the receiver already knows counts as its bytes'.
    with pytest.raises(WrongBaseError, match="version 7, bucket 2"):
        decode(delta, previous.clone(), base_version=6, base_checksum=delta.base_checksum ^ 1)


def test_a_corrupt_delta_fails_its_result_checksum():
    previous = _bucket(12)
    delta = encode(previous, _changed(previous, 0.01, 13), base_version=1, bucket="bucket bad")
    delta.parts[1].view(torch.int16)[0] += 1
    with pytest.raises(ChecksumError, match="bucket bad: after applying its indices delta"):
        decode(delta, previous.clone(), base_version=1)


def _words_changed(words: list[int], total_words: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    previous = torch.zeros(total_words, dtype=torch.int32)
    new = previous.clone()
    new[words] = 0x00010001  # both bf16 halves of each word
    return previous.view(torch.bfloat16), new.view(torch.bfloat16)


@pytest.mark.parametrize(
    ("words", "indices", "xor", "kind"),
    [
        ([0, 5], 4 * 6, 2 * (8 + 4), "indices"),  # scattered: an index per value is cheaper
        ([0, 1, 2, 3], 8 * 6, 8 + 4 * 4, "xor"),  # a run: one header for its words
        ([0, GAP_WORDS + 0], 4 * 6, 8 + (GAP_WORDS + 1) * 4, "xor"),  # a short gap stays in
        ([0, GAP_WORDS + 2], 4 * 6, 2 * (8 + 4), "indices"),  # a longer one splits the run
        (list(range(62)), 124 * 6, 8 + 62 * 4, "full"),  # neither below the 256 bytes
    ],
)
def test_the_smallest_form_is_chosen(words, indices, xor, kind):
    previous, new = _words_changed(words)
    got = sizes(previous, new)
    assert (got.indices, got.xor, got.full, got.kind) == (indices, xor, 256, kind)
    delta = encode(previous, new, base_version=1, bucket="b")
    assert delta.kind == kind
    assert delta.payload_bytes == {"indices": indices, "xor": xor, "full": 256}[kind]
    held = previous.clone()
    decode(delta, held, base_version=1)
    assert _same_bits(held, new)


def test_buckets_that_do_not_fit_are_refused_naming_them():
    with pytest.raises(ConfigError, match="bucket x: a delta needs two versions"):
        encode(_bucket(1, 256), _bucket(1, 384), base_version=1, bucket="bucket x")
    with pytest.raises(ConfigError, match="bucket y: deltas take buckets of a multiple of 256"):
        encode(_bucket(1, 100), _bucket(2, 100), base_version=1, bucket="bucket y")


def test_the_bench_rows_are_exact_and_pick_the_form_the_changes_call_for(capsys):
    """``python -m weightsync.app.bench.deltas`` on a tiny shape: the Adam steps at lr 1e-6
    change a few of the bf16 values, scattered (index form), and fewer of the e4m3 values of
    the same steps in FP8 form; whole rows changed go as XOR."""
    import json

    from weightsync.app.bench import deltas as bench

    argv = ["--model", "tiny", "--warmup-steps", "2", "--synthetic-mb", "1", "--fp8"]
    assert bench.main([*argv, "--bucket-size-mb", "1", "--sparsities", "0.01"]) == 0
    rows = {r["case"]: r for r in json.loads(capsys.readouterr().out.splitlines()[-1])}
    first = rows["tiny layer, Adam step 1 at lr 1e-06"]
    assert 0 < first["changed"] < 0.25 and first["ratio"] < 0.25
    # e4m3 keeps 3 bits of mantissa to bf16's 7: the same step changes fewer of its values.
    fp8 = rows["FP8 tiny layer, Adam step 1 at lr 1e-06"]
    assert 0 < fp8["changed"] < first["changed"] and fp8["full_bytes"] < first["full_bytes"]
    assert fp8["kinds"] == {"indices": 1}
    assert rows["synthetic 0.01 scattered"]["kinds"] == {"indices": 1}
    assert rows["synthetic 0.01 whole rows"]["kinds"] == {"xor": 1}
    assert all(r["bit_exact"] for r in rows.values())


def _patterned(pattern: str, dtype: torch.dtype, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two versions of a bucket of ``nbytes`` in ``dtype`` changed in ``pattern``."""
    g = torch.Generator().manual_seed(len(pattern) + nbytes)
    previous = torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), generator=g, dtype=torch.int32)
    new = previous.clone()
    words = nbytes // 4
    if pattern == "scattered":
        at = torch.randperm(words, generator=g)[: max(1, words // 40)]
    elif pattern == "gaps":  # consecutive changed words 1..5 apart: runs join and split
        at = torch.cumsum(torch.randint(1, 6, (words // 4,), generator=g), 0)
        at = at[at < words]
    elif pattern == "clustered":
        at = torch.arange(words // 3, words // 3 + words // 4)
    elif pattern == "all":
        at = torch.arange(words)
    else:
        at = torch.zeros(0, dtype=torch.long)
    new[at] ^= torch.randint(1, 2**16, (at.numel(),), generator=g, dtype=torch.int32) << (
        16 * (at % 2)  # one half or the other of each word, or for bytes one of its bytes
    ).to(torch.int32)
    new[at[::7]] ^= -1  # and some whole words
    return previous.view(dtype), new.view(dtype)


@pytest.mark.parametrize("pattern", ["none", "scattered", "gaps", "clustered", "all"])
@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int32]
)
@pytest.mark.parametrize("nbytes", [256, 768, 256 * 37])
def test_the_gpu_scan_and_the_cpu_scan_give_the_same_delta_bit_for_bit(pattern, dtype, nbytes):
    """Encoding takes whole-bucket masks on CUDA (``delta_scan.dense``) and the changed words
    alone on CPU (``delta_scan.sparse``): here both run on CPU, on odd sizes, every element
    size and every kind of change, and agree on the sizes, the checksums and every part."""
    from weightsync import delta_scan

    previous, new = _patterned(pattern, dtype, nbytes)
    old, cur = previous.view(torch.uint8), new.view(torch.uint8)
    unit = new.element_size()
    scans = [delta_scan.sparse(old, cur, unit), delta_scan.dense(old, cur, unit)]
    changed = int((previous != new).sum()) if dtype.is_floating_point is False else None
    for scan in scans:
        assert (scan.base_checksum, scan.checksum) == (checksum_of(old), checksum_of(cur))
        if changed is not None:
            assert scan.changed == changed
    fields = [(s.changed, s.runs, s.covered) for s in scans]
    assert fields[0] == fields[1]
    for form in ("indices", "xor"):
        sparse_parts, dense_parts = (getattr(s, form)() for s in scans)
        for a, b in zip(sparse_parts, dense_parts, strict=True):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        delta = Delta("b", form, 1, scans[0].base_checksum, scans[0].checksum, nbytes, unit,
                      sparse_parts)  # fmt: skip
        held = previous.clone()
        decode(delta, held, base_version=1)
        assert _same_bits(held, new)
    delta = encode(previous, new, base_version=1, bucket="b")
    if pattern == "none":
        assert (delta.kind, delta.payload_bytes) == ("indices", 0)
    if pattern == "all":
        assert delta.kind == "full"
    held = previous.clone()
    decode(delta, held, base_version=1)
    assert _same_bits(held, new)


def test_bytes_that_do_not_start_8_byte_aligned_are_refused_naming_the_bucket():
    previous, new = _patterned("gaps", torch.bfloat16, 1024 + 16)
    old, cur = previous.view(torch.uint8), new.view(torch.uint8)
    delta = encode(old[8:-8], cur[8:-8], base_version=2, bucket="b", element_bytes=2)
    held = old[8:-8].clone()
    decode(delta, held, base_version=2)
    assert torch.equal(held, cur[8:-8])
    with pytest.raises(ConfigError, match="b: deltas compare 64-bit words"):
        encode(old[4:-12], cur[4:-12], base_version=2, bucket="b")
