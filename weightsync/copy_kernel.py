"""Many same-GPU copies in one kernel launch, when CuPy is installed.

``torch._foreach_copy_`` launches a kernel per few dozen tensors and is slower per byte than a
flat copy (launches, not bytes, dominate an MoE model's thousands of tensors). Here every copy
is cut into chunks of about :data:`CHUNK_BYTES`, a table of them is built once on the GPU, and
one launch copies them all, a CUDA block per chunk, 16 bytes per load where both ends are
16-byte aligned. Strided copies whose rows are contiguous (a TP shard's columns: thousands for
MoE experts, each its own launch in torch) and large contiguous copies go in the same launch:
one launch has no tail between copies. Measured against a flat copy: docs/benchmarks.md.

The kernels' CUDA source is :mod:`.copy_kernel_source`; this module compiles and launches them
(with the block FP8 kernel of :mod:`.fp8_kernel_source` and the delta scan of
:mod:`.delta_kernel_source`, one module for all) and builds the
copy kernel's table. The same launch path serves the copy that also takes the
bucket checksum (``copy_sum``, planned by :mod:`.summed_copies`): each 8-byte word is summed as
it passes through registers, so a bucket is read once, not once by its copies and again by
:func:`~.checksum.row_sums`.

CuPy is optional (no extra installs it: its wheel is per CUDA major, ``cupy-cuda12x`` or
``cupy-cuda13x``); without it, on CPU, or with ``WEIGHTSYNC_COPY_KERNEL=0`` (to compare),
callers keep torch's copies.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from weightsync import copy_kernel_source, delta_kernel_source, fp8_kernel_source

log = logging.getLogger("weightsync")

CHUNK_BYTES = 128 << 10
"""Bytes per table row of a contiguous copy: the fastest of 64 KiB to 512 KiB on H200
(smaller blocks leave a shorter tail as the last wave drains; docs/benchmarks.md)."""
BOX_CHUNK_BYTES = 256 << 10
"""Bytes of a table row of whole strided rows (a box, e.g. a row-parallel TP shard): the
fastest of 128 KiB to 512 KiB on H200."""
THREADS = 1024
"""Threads per block: 1024 beat 256 and 512 on H200 for both kernels and every chunk size."""
KERNELS = {
    "copy_chunks": THREADS,
    "copy_sum": THREADS,
    "copy_sum_also": THREADS,
    "quantize_fp8": 256,
    "delta_scan": THREADS,
    "delta_indices": THREADS,
}
"""Each kernel by name, with its threads per block (its ``__launch_bounds__``)."""
SOURCE = copy_kernel_source.SOURCE + fp8_kernel_source.SOURCE + delta_kernel_source.SOURCE
"""Every kernel's source, one module (the FP8 and delta kernels use the copy kernels' helpers)."""


@functools.cache
def _kernels():
    """CuPy and the compiled kernels by name, or None without CuPy (or when they cannot
    compile here)."""
    if os.environ.get("WEIGHTSYNC_COPY_KERNEL", "1") == "0":
        return None
    try:
        import cupy
    except ImportError:
        return None
    try:
        module = cupy.RawModule(code=SOURCE)
        kernels = {name: module.get_function(name) for name in KERNELS}
    except Exception as e:  # a CuPy that does not match this machine's CUDA
        log.warning(
            "batched copy kernel unavailable (%s: %s); using torch copies", type(e).__name__, e
        )
        return None
    return cupy, kernels


def launch(name: str, device: torch.device, blocks: int, *args: object) -> None:
    """Launch kernel ``name`` on ``device``'s current torch stream (integers as uint64)."""
    cupy, kernels = _kernels()
    stream = _cupy_stream(torch.cuda.current_stream(device).cuda_stream, device.index)
    with cupy.cuda.Device(device.index):
        kernels[name](
            (blocks,), (KERNELS[name],), tuple(cupy.uint64(a) for a in args), stream=stream
        )


@dataclass(frozen=True)
class _StreamHandle:
    """A raw ``cudaStream_t`` in the CUDA stream protocol, which CuPy 14 takes."""

    ptr: int

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


@functools.cache
def _cupy_stream(ptr: int, device: int):
    """CuPy's handle on a torch stream, made once per stream, not at every launch."""
    cupy = _kernels()[0]
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:  # CuPy 13, where ExternalStream is not yet deprecated
        return cupy.cuda.ExternalStream(ptr, device)
    return from_external(_StreamHandle(ptr))


def available(device: torch.device) -> bool:
    return device.type == "cuda" and _kernels() is not None


def cupy():
    """The CuPy module (where :func:`available`)."""
    return _kernels()[0]


def fits(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the kernel can copy ``src`` into ``dst``: the same bytes on one GPU, each a
    box of rows whose elements are contiguous (:func:`planes`)."""
    return dst.is_cuda and dst.device == src.device and tabled(dst, src)


def tabled(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """:func:`fits`, wherever the two are: a table row can describe the copy (the same bytes,
    each a box of rows whose elements are contiguous)."""
    return (
        dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.nbytes > 0
        and planes(dst, src) is not None
    )


@dataclass(frozen=True)
class Planes:
    """A copy as 2-D planes of ``rows`` rows of ``width`` contiguous bytes."""

    offsets: list[tuple[int, int]]
    """Each plane's first byte in the (source, destination) view."""
    rows: int
    width: int
    src_pitch: int
    dst_pitch: int


def planes(dst: torch.Tensor, src: torch.Tensor) -> Planes | None:
    """``src`` -> ``dst`` (same shape and dtype) as planes: dims that are contiguous in both
    merged; None unless both have a contiguous innermost dim and ``dst`` writes no byte
    twice (a positive stride on every dim)."""
    size = dst.element_size()
    dims: list[tuple[int, int, int]] = []
    for n, ds, ss in zip(dst.shape, dst.stride(), src.stride(), strict=True):
        if n == 1:
            continue
        if ds <= 0 or ss < 0:
            return None
        if dims and dims[-1][1] == n * ds and dims[-1][2] == n * ss:
            dims[-1] = (dims[-1][0] * n, ds, ss)
        else:
            dims.append((n, ds, ss))
    n, ds, ss = dims[-1] if dims else (1, 1, 1)
    if ds != 1 or ss != 1:
        return None
    if len(dims) < 2:
        return Planes([(0, 0)], 1, n * size, 0, 0)
    rows, dp, sp = dims[-2]
    if dp < n:  # rows that overlap in ``dst``
        return None
    offsets = [(0, 0)]
    for count, d_step, s_step in dims[:-2]:
        offsets = [(s + i * s_step * size, d + i * d_step * size)
                   for s, d in offsets for i in range(count)]  # fmt: skip
    return Planes(offsets, rows, n * size, sp * size, dp * size)


def chunks(width: int, rows: int) -> Iterator[tuple[int, int, int, int]]:
    """``rows`` rows of ``width`` bytes as table rows: (first row, byte offset in it, bytes per
    row, rows) each; whole rows, up to :data:`BOX_CHUNK_BYTES` of them, where one fits, else
    chunks of a single row of up to :data:`CHUNK_BYTES`."""
    if rows == 1 or width > BOX_CHUNK_BYTES:
        for r in range(rows):
            for o in range(0, width, CHUNK_BYTES):
                yield r, o, min(CHUNK_BYTES, width - o), 1
        return
    per = BOX_CHUNK_BYTES // width
    for r in range(0, rows, per):
        yield r, 0, width, min(per, rows - r)


def table(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The kernel's table for ``pairs`` (each :func:`fits`, GPU aside), int64 on the CPU: a
    row per chunk of one plane, in :func:`chunks`' order, of
    (source, destination, bytes per row, rows, source pitch, destination pitch).

    Worked out with array ops over every plane at once, paid whenever a new layout's copies
    are built (a receiver's first versions, an engine rank's first declared shard). NumPy, not
    torch: torch's CPU ops on tables this long run on its intra-op thread pool, which a host
    full of other processes' threads slows by an order of magnitude.
    """
    planes_ = []
    for dst, src in pairs:
        p = planes(dst, src)
        if p is None:
            raise ValueError(f"not a copy of contiguous rows: {tuple(dst.stride())}")
        s, d = src.data_ptr(), dst.data_ptr()
        planes_.extend(
            (s + so, d + do, p.src_pitch, p.dst_pitch, p.width, p.rows) for so, do in p.offsets
        )
    if not planes_:
        return torch.empty(0, 6, dtype=torch.int64)
    s0, d0, sp, dp, width, rows = np.array(planes_, dtype=np.int64).T
    # A plane is chunked as whole rows, ``per`` at a time, or (one row, or rows wider than a
    # chunk) row by row in ``cols`` chunks each: ``count`` chunks in all.
    wide = (rows == 1) | (width > BOX_CHUNK_BYTES)
    cols = np.where(wide, -(-width // CHUNK_BYTES), 1)
    per = np.where(wide, 1, BOX_CHUNK_BYTES // np.maximum(width, 1))
    count = -(-rows // per) * cols
    plane = np.repeat(np.arange(len(planes_)), count)
    j = np.arange(len(plane)) - np.repeat(np.cumsum(count) - count, count)
    cols, per, width, rows = cols[plane], per[plane], width[plane], rows[plane]
    sp, dp = sp[plane], dp[plane]
    r = j // cols * per
    o = j % cols * CHUNK_BYTES
    n = np.minimum(width - o, CHUNK_BYTES)
    k = np.minimum(per, rows - r)
    return torch.from_numpy(
        np.stack([s0[plane] + r * sp + o, d0[plane] + r * dp + o, n, k, sp, dp], axis=1)
    )


class ChunkedCopies:
    """Copies that :func:`fits` allows, as one launch (build once, :meth:`run` every
    version: the table holds addresses, which the views keep alive)."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs = tuple(pairs)
        self.device = self.pairs[0][0].device
        rows = table(self.pairs)
        self.chunks = len(rows)
        self._table = rows.view(-1).to(self.device)

    def run(self) -> None:
        launch("copy_chunks", self.device, self.chunks, self._table.data_ptr())
