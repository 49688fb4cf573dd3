"""The plan of copies that take the bucket checksum on the way (``summed_copies.plan_rows``).

The CUDA kernel that runs the rows needs a GPU (tests/gpu/test_copy_batch.py checks it against
``row_sums`` there); here the rows are run by a model of that kernel over a byte tensor whose
offsets stand for addresses: every row copies, then sums the summed side's 8-byte words (a
tail shorter than a word: the whole word) at its words' checksum row positions. Run in two
orders, so a row that depended on another's writes would show.
"""

from __future__ import annotations

import pytest
import torch

from weightsync.checksum import ROW_WORDS, finish, row_sums, whole_row_words
from weightsync.copy_kernel import BOX_CHUNK_BYTES, CHUNK_BYTES
from weightsync.summed_copies import NO_SUM, SUM_DESTINATION, Row, plan_rows, rows_by_device

_MASK = (1 << 64) - 1
BASE = 4096
"""Where the bucket starts in the model's memory (address 0 means "no destination")."""


def _position(word: int, whole: int) -> int:
    if word < whole:
        return word // ROW_WORDS + 1
    return whole // ROW_WORDS + (word - whole) // 32 + 1


def _run(rows: list[Row], memory: torch.Tensor, nbytes: int) -> int:
    whole = whole_row_words(nbytes)
    a = b = 0
    for row in rows:
        for r in range(row.rows):  # a box: rows of nbytes, each a pitch after the last
            src, dst = row.src + r * row.src_pitch, row.dst + r * row.dst_pitch
            if row.dst:
                memory[dst : dst + row.nbytes] = memory[src : src + row.nbytes]
            if row.flags & NO_SUM:
                continue
            summed = row.flags & SUM_DESTINATION
            start = dst if summed else src
            first = row.word + r * (row.dst_pitch if summed else row.src_pitch) // 8
            words = memory[start : start + -(-row.nbytes // 8) * 8].view(torch.int64).tolist()
            for k, w in enumerate(words):
                a += (w & _MASK) * _position(first + k, whole)
                b += w & _MASK
    signed = [(x & _MASK) - ((x & _MASK) >> 63 << 64) for x in (a, b)]
    return finish(torch.tensor(signed, dtype=torch.int64), nbytes)


def _memory(size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def _both_orders(rows: list[Row], memory: torch.Tensor, nbytes: int) -> tuple[int, torch.Tensor]:
    forward, backward = memory.clone(), memory.clone()
    got = _run(rows, forward, nbytes)
    assert _run(rows[::-1], backward, nbytes) == got
    assert torch.equal(forward, backward)
    return got, forward


# A bucket holding tensors of awkward lengths at aligned offsets, stale bytes in the padding,
# one tensor spanning several rows of the table and the bucket past its 64 KiB rows.
_ENTRIES = [(0, 6), (256, 600_001), (600_320, 8), (600_576, 70_000)]
_NBYTES = 670_720


def test_a_packed_bucket_is_summed_once_whole_padding_included_as_a_read_after_the_pack() -> None:
    sources = BASE + _NBYTES + 512
    memory = _memory(sources + _NBYTES, seed=1)
    copies = [(sources + at, BASE + at, n) for at, n in _ENTRIES]
    rows = plan_rows(copies, base=BASE, nbytes=_NBYTES, destination=True)
    assert rows is not None
    assert sum(r.nbytes for r in rows if r.dst) == sum(n for _, n in _ENTRIES)
    assert max(r.nbytes for r in rows) == CHUNK_BYTES
    got, after = _both_orders(rows, memory, _NBYTES)
    bucket = after[BASE : BASE + _NBYTES]
    for at, n in _ENTRIES:
        assert torch.equal(bucket[at : at + n], memory[sources + at : sources + at + n])
    assert got == finish(row_sums(bucket, _NBYTES), _NBYTES)


def test_a_receivers_reads_sum_what_they_skip_and_a_span_read_twice_once() -> None:
    params = BASE + _NBYTES + 1024
    memory = _memory(params + 2 * _NBYTES, seed=2)
    # The second tensor is not kept; the fourth goes into two parameters (tied weights).
    reads = [(0, 6), (600_320, 8), (600_576, 70_000)]
    copies = [(BASE + at, params + at, n) for at, n in reads]
    copies.append((BASE + 600_576, params + _NBYTES + 256, 70_000))
    rows = plan_rows(copies, base=BASE, nbytes=_NBYTES, destination=False)
    assert rows is not None
    assert {r.flags for r in rows if r.src >= BASE + 600_576 and r.dst} == {0, NO_SUM}
    got, after = _both_orders(rows, memory, _NBYTES)
    for src, dst, n in copies:
        assert torch.equal(after[dst : dst + n], memory[src : src + n])
    bucket = memory[BASE : BASE + _NBYTES]
    assert got == finish(row_sums(bucket, _NBYTES), _NBYTES)


def _columns(at: int, rows: int, width: int, pitch: int, shard: int) -> tuple:
    """The box that packs a shard of ``rows`` x ``width`` bytes (contiguous at ``shard``) into
    the bucket at ``BASE + at``, rows ``pitch`` apart."""
    return (shard, BASE + at, width, rows, width, pitch)


def test_shards_columns_packed_side_by_side_are_summed_once_as_boxes() -> None:
    """A TP=2 trainer's row-parallel weight: each rank's shard holds half of every row; the two
    boxes fill the tensor's bytes in the bucket, which is summed once, box by box."""
    shards = BASE + _NBYTES + 512
    memory = _memory(shards + _NBYTES, seed=4)
    rows_, width = 300, 1000  # a 300 x 2000-byte tensor: a table row holds ``per`` of its rows
    copies = [
        _columns(256, rows_, width, 2 * width, shards),
        _columns(256 + width, rows_, width, 2 * width, shards + rows_ * width),
        (shards + 2 * rows_ * width, BASE, 6),
        (shards + 2 * rows_ * width + 64, BASE + 600_576, 70_000),
    ]
    rows = plan_rows(copies, base=BASE, nbytes=_NBYTES, destination=True)
    assert rows is not None
    per = BOX_CHUNK_BYTES // width
    each_box = [per] * (rows_ // per) + ([rows_ % per] if rows_ % per else [])
    assert sorted(r.rows for r in rows if r.rows > 1) == sorted(each_box * 2)
    got, after = _both_orders(rows, memory, _NBYTES)
    bucket = after[BASE : BASE + _NBYTES]
    tensor = bucket[256 : 256 + 2 * rows_ * width].view(rows_, 2 * width)
    for half in range(2):
        shard = memory[shards + half * rows_ * width :][: rows_ * width].view(rows_, width)
        assert torch.equal(tensor[:, half * width : (half + 1) * width], shard)
    assert got == finish(row_sums(bucket, _NBYTES), _NBYTES)


def test_an_empty_bucket_and_one_no_copy_touches_are_summed_by_reads_alone() -> None:
    memory = _memory(BASE + 512, seed=3)
    assert plan_rows([], base=BASE, nbytes=0, destination=True) == []
    rows = plan_rows([(BASE, 1 << 20, 0)], base=BASE, nbytes=512, destination=False)
    assert rows is not None and all(r.dst == 0 for r in rows)
    got, _ = _both_orders(rows, memory, 512)
    assert got == finish(row_sums(memory[BASE : BASE + 512], 512), 512)


@pytest.mark.parametrize(
    ("copies", "destination"),
    [
        pytest.param([(9000, BASE + 4, 8)], True, id="unaligned-in-bucket"),
        pytest.param([(9001, BASE, 8)], True, id="unaligned-other-end"),
        pytest.param([(9000, BASE + 512, 8)], True, id="past-the-bucket"),
        pytest.param([(9000, BASE - 8, 16)], True, id="before-the-bucket"),
        pytest.param([(9000, BASE, 16), (9100, BASE + 8, 8)], True, id="overlapping-writes"),
        pytest.param([(9000, BASE, 16), (9000, BASE, 16)], True, id="one-place-written-twice"),
        pytest.param(
            [(BASE, 9000, 16), (BASE + 8, 9100, 16)], False, id="partly-overlapping-reads"
        ),
        pytest.param([(BASE, 9000, 6), (BASE, 9100, 8)], False, id="reads-sharing-a-tail-word"),
        # An engine TP=2 rank reads half of each row: the other half would need strided sums.
        pytest.param([(BASE, 9000, 16, 8, 32, 16)], False, id="half-of-every-row-read"),
        pytest.param(
            [_columns(0, 4, 12, 24, 9000), _columns(12, 4, 12, 24, 9048)],
            True,
            id="columns-not-8-byte-aligned",
        ),  # fmt: skip
        pytest.param(
            [_columns(0, 4, 16, 32, 9000), _columns(16, 4, 16, 32, 9064), (9200, BASE + 32, 8)],
            True,
            id="a-span-inside-two-boxes",
        ),
        pytest.param([_columns(0, 8, 16, 32, 9000)], True, id="half-the-columns-left-stale"),
    ],
)
def test_copies_the_kernel_cannot_sum_exactly_once_are_left_to_a_second_read(
    copies: list[tuple[int, ...]], destination: bool
) -> None:
    assert plan_rows(copies, base=BASE, nbytes=512, destination=destination) is None


def test_landed_rows_go_to_the_device_whose_memory_they_sum() -> None:
    """``LandedSums`` launches each row on the GPU of the memory it sums: the tensor starting
    closest at or below its address, even where another GPU's allocation lies between two
    tensors of one GPU, or one GPU's tensors start inside another of its tensors (views)."""
    starts = [(1000, "gpu1"), (9000, "gpu0"), (1400, "gpu1"), (5000, "gpu0")]  # any order
    rows = [Row(src, 0, 8, 0, 0) for src in (1000, 1300, 1400, 4000, 5000, 8999, 9000, 20000)]
    got = rows_by_device(rows, starts)
    assert {d: [r.src for r in rs] for d, rs in got.items()} == {
        "gpu1": [1000, 1300, 1400, 4000],
        "gpu0": [5000, 8999, 9000, 20000],
    }
