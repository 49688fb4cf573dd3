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


def test_detects_swapped_rows_and_swapped_words():
    b = buf()
    ref = bucket_checksum(b, 4096)
    rows = b.view(16, 256).clone()
    rows[[0, 1]] = rows[[1, 0]]
    assert bucket_checksum(rows.reshape(-1), 4096) != ref
    words = b.view(torch.int32).clone()
    words[[3, 7]] = words[[7, 3]]
    assert bucket_checksum(words.view(torch.uint8), 4096) != ref


def test_stale_zero_buffer_differs_from_data():
    assert bucket_checksum(torch.zeros(4096, dtype=torch.uint8), 4096) != bucket_checksum(
        buf(), 4096
    )
