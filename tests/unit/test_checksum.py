import torch

from weightsync.checksum import finish, finish_all, row_sums


def bucket_checksum(buffer, nbytes):
    """What a sender and its receivers compute for one bucket."""
    return finish(row_sums(buffer, nbytes), nbytes)


def buf(n=4096, seed=0):
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def test_same_bytes_same_checksum_and_length_matters():
    b = buf()
    assert bucket_checksum(b, 4096) == bucket_checksum(b.clone(), 4096)
    assert bucket_checksum(b, 4096) != bucket_checksum(b, 3840)


def test_detects_a_single_flipped_bit_anywhere():
    b = buf()
    ref = bucket_checksum(b, 4096)
    for pos in (0, 1, 255, 256, 2049, 4095):
        c = b.clone()
        c[pos] ^= 0x10
        assert bucket_checksum(c, 4096) != ref, pos


def test_detects_swapped_rows_and_shifted_bytes():
    b = buf(3 * 65536 + 512)
    n = b.numel()
    ref = bucket_checksum(b, n)
    rows = b[: 3 * 65536].view(3, 65536).clone()
    rows[[0, 1]] = rows[[1, 0]]
    assert bucket_checksum(torch.cat([rows.reshape(-1), b[3 * 65536 :]]), n) != ref
    tail = b.clone()
    tail[-512:] = torch.cat([b[-256:], b[-512:-256]])  # two 256-byte tail rows swapped
    assert bucket_checksum(tail, n) != ref
    for shift in (1, 8, 100, 65536):  # a packer that wrote at a wrong offset
        shifted = torch.roll(b, shift)
        assert bucket_checksum(shifted, n) != ref, shift


def _reference(b: torch.Tensor) -> int:
    """The algorithm in plain Python: 64 KiB rows, then 256-byte rows for the tail."""
    n = b.numel()
    words = [
        int.from_bytes(b[i : i + 8].numpy().tobytes(), "little", signed=True)
        for i in range(0, n, 8)
    ]
    whole = len(words) // 8192 * 8192
    rows = [sum(words[r : r + 8192]) for r in range(0, whole, 8192)]
    rows += [sum(words[r : r + 32]) for r in range(whole, len(words), 32)]
    mask = (1 << 64) - 1
    a = sum((i + 1) * s for i, s in enumerate(rows)) & mask
    s_ = sum(rows) & mask
    return (a * 0x9E3779B97F4A7C15 + s_ * 0xC2B2AE3D27D4EB4F + n) & mask


def test_matches_a_plain_python_reference_for_any_row_and_tail_split():
    for n in (256, 8192, 65536, 65536 + 256, 2 * 65536 + 4096):
        b = buf(n, seed=n)
        assert bucket_checksum(b, n) == _reference(b), n


def test_stale_zero_buffer_differs_from_data():
    assert bucket_checksum(torch.zeros(4096, dtype=torch.uint8), 4096) != bucket_checksum(
        buf(), 4096
    )


def test_wrapping_arithmetic_matches_the_reference_at_the_extremes():
    """Words near the int64 limits overflow every sum: the value still equals the reference."""
    g = torch.Generator().manual_seed(7)
    words = torch.randint(-(2**63), 2**63 - 1, (2 * 8192 + 64,), generator=g)
    b = words.view(torch.uint8)
    assert bucket_checksum(b, b.numel()) == _reference(b)


def test_sums_in_parts_finish_as_their_whole_wrapping_like_the_gpu():
    """A bucket's sums may come as parts (one per GPU, ``LandedSums``), beside whole ones: each
    bucket finishes to the checksum of its bytes, parts added with int64 wrap-around."""
    g = torch.Generator().manual_seed(8)
    words = torch.randint(-(2**63), 2**63 - 1, (2 * 8192 + 64,), generator=g)
    b = words.view(torch.uint8)
    n = b.numel()
    whole = row_sums(b, n)
    near_limit = torch.tensor([2**63 - 5, -(2**63) + 3])
    parts = (whole - near_limit, near_limit)  # each sum overflows when the parts are added
    other = buf(4096, seed=3)
    got = finish_all([parts, row_sums(other, 4096), (whole,)], [n, 4096, n])
    assert got == [_reference(b), _reference(other), _reference(b)]
