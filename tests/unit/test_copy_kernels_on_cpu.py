"""Our CUDA kernels' own source, run on the CPU (``tests/support/cuda_on_cpu.py``) over the
tables we plan for them: ``copy_chunks`` moves exactly the bytes of contiguous and strided
copies (and no other), ``copy_sum`` also gives ``row_sums``'s value, packing a bucket and
reading one (the GPU runs the same cases in tests/gpu)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support import cuda_on_cpu, kernel_cases
from weightsync import copy_kernel
from weightsync.checksum import finish, row_sums, whole_row_words
from weightsync.regions import _BITS
from weightsync.summed_copies import Row, also_column, landed_rows, plan_rows, spans_of, table


@pytest.fixture(autouse=True)
def _compiler() -> None:
    # A missing compiler fails these tests rather than skipping them (scripts/test.sh installs it).
    assert cuda_on_cpu.compiler(), "these tests build the kernels with g++ and its libubsan"


def _plan(case: kernel_cases.Case, destination: bool) -> list[Row]:
    rows = plan_rows(
        spans_of(case.pairs),
        base=case.bucket.data_ptr(),
        nbytes=case.nbytes,
        destination=destination,
    )
    assert rows is not None
    return rows


def _run(case: kernel_cases.Case, destination: bool) -> tuple[int, list[Row]]:
    rows = _plan(case, destination)
    return _launch(rows, case.nbytes), rows


def _launch(rows: list[Row], nbytes: int) -> int:
    rows_table = table(rows)
    out = torch.zeros(2, dtype=torch.int64)
    cuda_on_cpu.launch(
        "copy_sum", len(rows), rows_table.data_ptr(), whole_row_words(nbytes), out.data_ptr(),
    )  # fmt: skip
    return finish(out, nbytes)


@kernel_cases.SUMMED
def test_the_kernel_sums_the_whole_bucket_once_and_moves_every_byte(make, destination):
    case = make("cpu")
    got, rows = _run(case, destination)
    # Boxes (a shard's columns) are copied and summed where they are, not gathered first.
    assert any(r.rows > 1 for r in rows) == (make is kernel_cases.columns)
    assert kernel_cases.moved(case)
    assert got == finish(row_sums(case.bucket, case.nbytes), case.nbytes)
    # Reading: a bit of a tensor's last word. Packing: of the padding in that word, which the
    # pack leaves as it was (and the receivers' reads sum, so the sender must too).
    case.bucket[case.flip + destination] ^= 1
    flipped, _ = _run(case, destination)
    assert flipped != got
    assert flipped == finish(row_sums(case.bucket, case.nbytes), case.nbytes)


@pytest.mark.parametrize(
    "make", [kernel_cases.packing, kernel_cases.columns], ids=["whole", "columns"]
)
@pytest.mark.parametrize("skew", [0, 8], ids=["16-aligned", "8-aligned"])
def test_a_pack_writes_a_receivers_weights_in_the_same_launch(make, skew):
    """``copy_sum_also``: the sender's pack also writes each tensor into a receiver's weights
    (a contiguous tensor each, TP shards' columns into theirs): the bucket packed and summed as
    by ``copy_sum``, the weights equal to the bucket's bytes, nothing else written."""
    case = make("cpu")
    moves, weights = kernel_cases.weights_of(case, skew)
    rows = table(_plan(case, destination=True))
    column = also_column(rows, case.bucket.data_ptr(), moves)
    assert column is not None
    assert int((column != 0).sum()) < len(rows)  # the padding's sum-only rows write nothing
    out = torch.zeros(2, dtype=torch.int64)
    fused = torch.cat([rows, column[:, None]], dim=1)
    cuda_on_cpu.launch(
        "copy_sum_also", len(fused), fused.data_ptr(), whole_row_words(case.nbytes),
        out.data_ptr(),
    )  # fmt: skip
    assert kernel_cases.moved(case)
    assert finish(out, case.nbytes) == finish(row_sums(case.bucket, case.nbytes), case.nbytes)
    assert kernel_cases.written(case, moves, weights)


def test_a_second_destination_is_refused_unless_every_byte_is_written_once():
    case = kernel_cases.columns("cpu")
    moves, _ = kernel_cases.weights_of(case)
    rows = table(_plan(case, destination=True))
    base = case.bucket.data_ptr()
    assert also_column(rows, base, moves) is not None
    assert also_column(rows, base, []) is None
    start, n, address = moves[0]
    # One tensor's bytes to two places (a receiver tying two parameters to one tensor).
    assert also_column(rows, base, [*moves, (start, n, address + (1 << 30))]) is None
    # A move from the middle of a tensor's rows: a table row crosses its start.
    assert also_column(rows, base, [(start + 8, n - 8, address), *moves[1:]]) is None
    # A move over bytes no row writes (the padding after a tensor).
    assert also_column(rows, base, [(start, n + 64, address), *moves[1:]]) is None
    # Fewer tensors than the bucket holds: the others' rows write nothing more.
    column = also_column(rows, base, moves[1:])
    assert column is not None and int((column != 0).sum()) < int(
        (also_column(rows, base, moves) != 0).sum()
    )


def _columns_read(device: str) -> kernel_cases.Case:
    """A TP=2 engine's two ranks reading their columns of each tensor out of one bucket."""
    case = kernel_cases.columns(device)
    return kernel_cases.Case(case.bucket, case.nbytes, [(s, d) for d, s in case.pairs], case.flip)


@pytest.mark.parametrize("make", [kernel_cases.reading, _columns_read], ids=["whole", "columns"])
def test_reads_into_another_gpu_are_summed_where_they_landed_not_in_the_bucket(make):
    """Reads from a bucket on another GPU run on the copy engines, so their checksum is taken
    after them (``landed_rows``): of the parameters' bytes, each under its bucket word, and of
    the bucket only where no copy lands (padding, tensors not kept, last partial words)."""
    case = make("cpu")
    for dst, src in case.pairs:
        dst.copy_(src)
    want = finish(row_sums(case.bucket, case.nbytes), case.nbytes)
    rows = landed_rows(_plan(case, destination=False))
    assert any(r.rows > 1 for r in rows) == (make is _columns_read)
    assert _launch(rows, case.nbytes) == want
    # What the bucket holds now is not what it proves: every landed word is read where it is.
    at = case.pairs[1][1].data_ptr() - case.bucket.data_ptr() + 16
    case.bucket[at] ^= 1
    assert _launch(rows, case.nbytes) == want
    case.bucket[at] ^= 1
    # A word that did not land as the bucket holds it (a copy that read the bucket too early,
    # or wrote past its place) fails (columns: a shard read out of the bucket's strided rows).
    dst = case.pairs[1][0]
    dst.view(_BITS[dst.element_size()])[tuple(n // 2 for n in dst.shape)] ^= 1
    assert _launch(rows, case.nbytes) != want


def test_one_launch_moves_exactly_the_bytes_of_strided_and_contiguous_copies() -> None:
    g = torch.Generator().manual_seed(4)
    a_bytes, b_bytes = kernel_cases.STRIDED_BYTES
    a = torch.randint(0, 256, (a_bytes,), dtype=torch.uint8, generator=g)
    b = torch.randint(0, 256, (b_bytes,), dtype=torch.uint8, generator=g)
    want, b_before = a.clone(), b.clone()
    for dst, src in kernel_cases.strided(want, b):
        dst.copy_(src)
    pairs = kernel_cases.strided(a, b)
    assert all(copy_kernel.planes(d, s) is not None for d, s in pairs)
    rows = copy_kernel.table(pairs)
    assert set((rows[:, 3] > 1).tolist()) == {True, False}  # boxes of rows, contiguous chunks
    cuda_on_cpu.launch("copy_chunks", len(rows), rows.data_ptr())
    assert torch.equal(a, want)
    assert torch.equal(b, b_before)


def test_copies_the_kernel_cannot_take_are_left_to_torch() -> None:
    t = torch.zeros(8, 16)
    assert copy_kernel.planes(t.t(), torch.zeros(16, 8)) is None  # columns of a transpose
    assert copy_kernel.planes(torch.zeros(8, 1).expand(8, 4), torch.zeros(8, 4)) is None
    assert copy_kernel.planes(t[:, ::2], torch.zeros(8, 8)) is None  # every other element
    assert copy_kernel.planes(t[2:6], torch.zeros(4, 16)) == copy_kernel.Planes(
        [(0, 0)], 1, 4 * 16 * 4, 0, 0
    )  # whole rows: one contiguous run


def test_the_table_has_a_row_per_chunk_of_every_plane_in_order():
    """The table, worked out for all planes at once, is each plane's :func:`chunks` in turn:
    rows wider than a box's chunk cut in pieces, a single row, whole rows ``per`` at a time,
    and planes of a 3-D box (one per leading index)."""
    chunk = copy_kernel.BOX_CHUNK_BYTES
    buf = torch.empty(8 << 20, dtype=torch.uint8)

    def at(offset: int, *shape: int) -> torch.Tensor:
        n = math.prod(shape)
        return buf[offset : offset + n].view(shape)

    wide = at(0, 3, chunk + 100)
    pairs = [
        (wide, at(4 << 20, 3, chunk + 100)),  # cut in pieces
        (buf[:1000], buf[5000:6000]),  # one row
        (at(0, 200, 64)[:, :48], at(6 << 20, 200, 48)),  # whole rows, many per chunk
        (at(0, 2, 300, 16)[:, :100, :8], at(7 << 20, 2, 100, 8)),  # two planes
    ]
    want = []
    for dst, src in pairs:
        p = copy_kernel.planes(dst, src)
        for so, do in p.offsets:
            s, d = src.data_ptr() + so, dst.data_ptr() + do
            want.extend(
                [s + r * p.src_pitch + o, d + r * p.dst_pitch + o, n, k, p.src_pitch, p.dst_pitch]
                for r, o, n, k in copy_kernel.chunks(p.width, p.rows)
            )
    got = copy_kernel.table(pairs)
    assert got.dtype == torch.int64 and got.tolist() == want
    assert {row[3] for row in want} == {1, 100, 200}
    cut = list(copy_kernel.chunks(chunk + 100, 3))  # the wide rows: a piece at a time
    assert len(cut) > 3 and {k for *_, k in cut} == {1}
    assert len(copy_kernel.planes(*pairs[-1]).offsets) == 2
    assert copy_kernel.table([]).shape == (0, 6)
