import torch

from weightsync.checksum import bucket_checksum


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
    b = buf()
    ref = bucket_checksum(b, 4096)
    rows = b.view(16, 256).clone()
    rows[[0, 1]] = rows[[1, 0]]
    assert bucket_checksum(rows.reshape(-1), 4096) != ref
    for shift in (1, 8, 100):  # a packer that wrote at a wrong offset
        shifted = torch.roll(b, shift)
        assert bucket_checksum(shifted, 4096) != ref, shift


def test_matches_a_plain_python_reference():
    b = buf(8192, seed=3)
    words = [
        int.from_bytes(b[i : i + 8].numpy().tobytes(), "little", signed=True)
        for i in range(0, 8192, 8)
    ]
    rows = [sum(words[r * 32 : (r + 1) * 32]) for r in range(len(words) // 32)]
    mask = (1 << 64) - 1
    a = sum((i + 1) * s for i, s in enumerate(rows)) & mask
    s_ = sum(rows) & mask
    expected = (a * 0x9E3779B97F4A7C15 + s_ * 0xC2B2AE3D27D4EB4F + 8192) & mask
    assert bucket_checksum(b, 8192) == expected


def test_stale_zero_buffer_differs_from_data():
    assert bucket_checksum(torch.zeros(4096, dtype=torch.uint8), 4096) != bucket_checksum(
        buf(), 4096
    )


def test_blockwise_position_weighting_equals_the_plain_sum_modulo_2_64():
    """Row sums are weighted by position in blocks (no bucket-long temporary); the value must
    equal sum((r + 1) * row_sum[r]) mod 2**64, overflow included, for any block/tail split."""
    from weightsync.checksum import _BLOCK, _ROW_BYTES, row_sums

    g = torch.Generator().manual_seed(7)
    for rows in (1, _BLOCK - 1, _BLOCK, 2 * _BLOCK + 5):
        words = torch.randint(-(2**62), 2**62, (rows * _ROW_BYTES // 8,), generator=g)
        buffer = words.view(torch.uint8)
        row = [sum(words[r * 32 : (r + 1) * 32].tolist()) for r in range(rows)]
        mask = (1 << 64) - 1
        weighted = sum((r + 1) * s for r, s in enumerate(row)) & mask
        got = [int(x) & mask for x in row_sums(buffer, buffer.numel()).tolist()]
        assert got == [weighted, sum(row) & mask], rows
