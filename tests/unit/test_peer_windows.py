"""How a receiver's small pieces from another GPU cross into its landing windows
(:func:`weightsync.peer_copies.plan_windows`): pure, so it runs here; the copies it plans run
in tests/gpu/test_copy_batch.py and ``python -m weightsync.app.bench.fp8``."""

from __future__ import annotations

import random

from weightsync.peer_copies import BRIDGE_BYTES, Piece, plan_windows

MIB = 1 << 20
BASE = 0x7F00_0000_0000


def fp8_experts(n: int, base: int = BASE, allocation: int = 1) -> list[Piece]:
    """A bucket of FP8 experts: each 768 x 2048 e4m3 weight, then its 6 x 16 float32 scales
    (384 bytes), every entry at a 256-byte boundary."""
    pieces, at = [], base
    for _ in range(n):
        for nbytes in (768 * 2048, 384):
            pieces.append(Piece(at, nbytes, allocation))
            at += -(-nbytes // 256) * 256
    return pieces


def check_lands_every_piece(pieces: list[Piece], window_bytes: int):
    """Every piece lies in one window where one of its copies put its source bytes, as
    aligned as in its source, and no window holds more than it may (but a piece of its own)."""
    windows = plan_windows(pieces, window_bytes)
    got = [(w, start) for w in windows for start in w.starts]
    assert len(got) == len(pieces)
    for piece, (window, start) in zip(pieces, got, strict=True):
        assert start % 256 == piece.ptr % 256
        assert any(
            offset <= start
            and start + piece.nbytes <= offset + n
            and src + (start - offset) == piece.ptr
            for offset, src, n in window.copies
        ), (piece, start, window.copies)
    for window in windows:
        if len(window.starts) > 1:
            assert max(o + n for o, _, n in window.copies) <= window_bytes
    return windows


def test_an_fp8_buckets_experts_and_their_padded_scales_cross_in_one_copy_per_window():
    pieces = fp8_experts(40)  # ~61 MiB: one 64 MiB window
    windows = check_lands_every_piece(pieces, 64 * MIB)
    assert [len(w.copies) for w in windows] == [1]
    offset, src, n = windows[0].copies[0]
    assert (offset, src) == (0, BASE) and n == pieces[-1].ptr + 384 - BASE


def test_windows_split_where_they_fill_and_each_starts_a_copy():
    pieces = fp8_experts(120)  # ~184 MiB
    windows = check_lands_every_piece(pieces, 64 * MIB)
    assert len(windows) == 3 and all(len(w.copies) == 1 for w in windows)


def test_gaps_are_bridged_only_inside_one_allocation_and_only_small_ones():
    first = fp8_experts(4)
    after = first[-1].ptr + 512  # 128 bytes after the last scale: bridged were it one allocation
    two_allocations = first + fp8_experts(4, after, allocation=2)
    assert [
        len(w.copies) for w in check_lands_every_piece(first + fp8_experts(4, after), 64 * MIB)
    ] == [1]
    assert [len(w.copies) for w in check_lands_every_piece(two_allocations, 64 * MIB)] == [2]
    big_gap = [Piece(BASE, 4096, 1), Piece(BASE + 4096 + BRIDGE_BYTES + 256, 4096, 1)]
    assert [len(w.copies) for w in check_lands_every_piece(big_gap, 64 * MIB)] == [2]
    small_gap = [Piece(BASE, 4096, 1), Piece(BASE + 4096 + BRIDGE_BYTES, 4096, 1)]
    assert [len(w.copies) for w in check_lands_every_piece(small_gap, 64 * MIB)] == [1]


def test_adjacent_pieces_join_and_a_piece_read_twice_lands_twice():
    pieces = [
        Piece(BASE, 1000, 1),
        Piece(BASE + 1000, 24, 1),  # adjacent: the same copy
        Piece(BASE + 1000, 24, 1),  # the same bytes again (read into two parameters)
        Piece(BASE + 4096, 512, 2),
    ]
    windows = check_lands_every_piece(pieces, 64 * MIB)
    assert [n for _, _, n in windows[0].copies] == [1024, 24, 512]


def test_random_layouts_land_every_piece_where_its_copy_put_it():
    rng = random.Random(7)
    for _ in range(200):
        pieces, at = [], BASE + rng.randrange(256)
        for _ in range(rng.randrange(1, 60)):
            at += rng.choice([0, 0, 128, 256, rng.randrange(2 * BRIDGE_BYTES)])
            nbytes = rng.choice([8, 384, 4096, rng.randrange(1, 3 * MIB)])
            pieces.append(Piece(at, nbytes, at // (64 * MIB)))
            at += nbytes if rng.random() < 0.9 else -nbytes // 2
        pieces.sort(key=lambda p: p.ptr)
        check_lands_every_piece(pieces, 4 * MIB)
