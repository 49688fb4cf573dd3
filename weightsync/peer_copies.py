"""Copies from one GPU's memory into another's, on the copy engines, with one ordering point.

torch's ``copy_`` across GPUs puts a two-way barrier between both GPUs' streams around every
copy; a direct read of a sharded trainer's tensors is hundreds (MoE: thousands) of pieces from
a peer, and those barriers kept 4 x H200 node reads near half the NVLink bandwidth. Here the
pieces of one batch are plain asynchronous copies (``cudaMemcpyAsync``) queued on the source
GPU's stream, ordered after the sources' streams (and, where they write a destination, its
stream) and once before the destinations' streams.

Copy engines, not a kernel: copies from another process's memory then run beside that GPU's
own copy kernels, where a kernel would share its SMs with the other process's by time slices.
The copy engines move contiguous bytes at the link's speed but narrow strided rows slowly (a
row-parallel shard landing in its columns of the whole tensor), so a piece whose destination
is strided, or that is small, crosses the link contiguous, into a landing window on the
destination GPU, and a copy kernel there puts it in place: two windows per link, the next
crossing while the last is put in place. Measured in docs/benchmarks.md. Needs CuPy for the
runtime calls and the kernel; without it callers keep torch's copies.

A destination reading from several peers reads them one after another, in rounds
(:func:`rounds`): GPU ``d`` takes from GPU ``s`` in round ``d ^ s``. When every GPU of a node
reads from every other (a trainer TP=4 into engines TP=1), each round pairs the GPUs up, and copy
engines move bytes between pairs at 386 GB/s into each GPU against 229 GB/s when each reads from
three at once (4 x H200).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from weightsync import copy_kernel

WINDOW_BYTES = 64 << 20
"""Bytes of one landing window; each link that lands pieces holds two on its destination
(16 and 256 MiB were within 10% of it on 4 x H200)."""
DIRECT_MIN_BYTES = 4 << 20
"""A contiguous piece at least this large crosses straight into place; smaller ones land
(an MoE trainer's thousands of expert shards cross as a few runs of its memory, not a copy
each: a copy engine pays microseconds per copy, and so does the call that queues it)."""
_MEMCPY_DEFAULT = 4
"""cudaMemcpyDefault: the direction from the (unified) addresses."""
_PEER_ACCESS_ALREADY_ENABLED = 704
"""cudaErrorPeerAccessAlreadyEnabled: torch enables peer access itself on its peer copies."""
_ALIGN = 256

Pair = tuple[torch.Tensor, torch.Tensor]


@functools.cache
def _peer_access(src: int, dst: int) -> bool:
    """Whether GPU ``src`` reaches GPU ``dst``'s memory directly; enabled here once (copies
    between GPUs without it go through host memory)."""
    if not torch.cuda.can_device_access_peer(src, dst):
        return False
    cupy = copy_kernel.cupy()
    with cupy.cuda.Device(src):
        try:
            cupy.cuda.runtime.deviceEnablePeerAccess(dst)
        except cupy.cuda.runtime.CUDARuntimeError as e:
            if e.status != _PEER_ACCESS_ALREADY_ENABLED:
                raise
    return True


def fits(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether :class:`PeerCopies` takes the copy: the same bytes on two GPUs that reach each
    other, the source contiguous, the destination a box of contiguous rows."""
    return (
        dst.is_cuda
        and src.is_cuda
        and dst.device != src.device
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.nbytes > 0
        and src.is_contiguous()
        and copy_kernel.available(dst.device)
        and copy_kernel.planes(dst, src) is not None
        and _peer_access(src.device.index, dst.device.index)
    )


def _rows(dst: torch.Tensor, src: torch.Tensor, limit: int) -> list[Pair]:
    """``(dst, src)`` cut along dim 0 into parts of at most ``limit`` bytes where it can be."""
    if dst.dim() == 0 or src.nbytes <= limit:
        return [(dst, src)]
    step = max(1, limit // (src.nbytes // max(src.shape[0], 1) or 1))
    return [(dst[i : i + step], src[i : i + step]) for i in range(0, src.shape[0], step)]


BRIDGE_BYTES = 64 << 10
"""A gap of up to this many bytes between two pieces of one source allocation crosses with
them (landing unused in the window): the padding after a small piece (an FP8 expert's
384-byte scales, aligned to 256) would otherwise end every run, a copy engine call per piece
(thousands per MoE bucket, 2-3 ms of queueing each on H200). 64 KiB cross in well under a
microsecond; the call costs microseconds."""


class Piece(NamedTuple):
    """A source piece to land: its address, size and allocation (gaps are bridged only
    inside one)."""

    ptr: int
    nbytes: int
    allocation: int


class Window(NamedTuple):
    starts: list[int]
    """Each piece's byte offset in the window (as aligned as its source)."""
    copies: list[tuple[int, int, int]]
    """What crosses: (offset in the window, source address, bytes), runs of the source."""


def plan_windows(pieces: Sequence[Piece], window_bytes: int) -> list[Window]:
    """``pieces`` (sorted by address) cut into windows of at most ``window_bytes`` (a larger
    piece gets one of its own) and each window into as few copies as its source allows:
    pieces adjacent in the source, or apart by at most :data:`BRIDGE_BYTES` of one
    allocation, are one copy and lie as far apart in the window. Pure: tested on CPU."""
    windows: list[Window] = []
    at, run_end, allocation = 0, -1, None
    for piece in pieces:
        gap = piece.ptr - run_end
        joins = gap == 0 or (piece.allocation == allocation and 0 < gap <= BRIDGE_BYTES)
        start = at + gap if joins else -(-at // _ALIGN) * _ALIGN + piece.ptr % _ALIGN
        if not windows or start + piece.nbytes > window_bytes:
            windows.append(Window([], []))
            start, joins = piece.ptr % _ALIGN, False
        window = windows[-1]
        window.starts.append(start)
        if joins:
            offset, src, _ = window.copies[-1]
            window.copies[-1] = (offset, src, start + piece.nbytes - offset)
        else:
            window.copies.append((start, piece.ptr, piece.nbytes))
        at, run_end, allocation = start + piece.nbytes, piece.ptr + piece.nbytes, piece.allocation
    return windows


class _Landing:
    """The pieces one link lands: windows of them, each a few copies (runs of adjacent
    source memory, which the windows mirror) and one copy kernel launch putting them in place."""

    def __init__(self, pairs: list[Pair]) -> None:
        src_device, self.device = pairs[0][1].device, pairs[0][0].device
        parts = [part for dst, src in pairs for part in _rows(dst, src, WINDOW_BYTES)]
        parts.sort(key=lambda pair: pair[1].data_ptr())
        pieces = [
            Piece(src.data_ptr(), src.nbytes, src.untyped_storage().data_ptr()) for _, src in parts
        ]
        planned = plan_windows(pieces, WINDOW_BYTES)
        windows, k = [], 0
        for window in planned:
            n = len(window.starts)
            windows.append(list(zip(parts[k : k + n], window.starts, strict=True)))
            k += n
        size = max(start + pair[1].nbytes for window in windows for pair, start in window)
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in "ab"]
        self.copies = [window.copies for window in planned]
        """Per window: (offset, source address, bytes)."""
        self.puts: list[list[copy_kernel.ChunkedCopies]] = []  # per window, per buffer
        for window in windows:
            self.puts.append(
                [
                    copy_kernel.ChunkedCopies(
                        [(dst, _landed(buffer, start, src)) for (dst, src), start in window]
                    )
                    for buffer in self.buffers
                ]
            )
        # High priority: the destination's own copy kernel fills every SM for milliseconds,
        # and a put waiting behind its blocks holds back the crossing of window k + 2 (2 x H100:
        # the 7B TP=2 node read 28.6 -> 25.0 ms, the MoE one 31.2 -> 26.9 ms).
        self.stream = torch.cuda.Stream(self.device, priority=-1)
        """Where the landed pieces are put in place, beside the destination's own copies."""
        self._crossed = [torch.cuda.Event() for _ in self.buffers]
        self._put = [torch.cuda.Event() for _ in self.buffers]
        self.source = src_device

    def start(self, runtime, source: torch.cuda.Stream) -> None:
        """Queue every window: across on ``source`` (a stream of the source GPU), in place on
        :attr:`stream`."""
        handle = source.cuda_stream
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for k, (copies, puts) in enumerate(zip(self.copies, self.puts, strict=True)):
            slot = k % 2
            # The window last put from this buffer (k - 2, or the last run's) is out of it; not
            # recorded yet (a first run's first two), the wait is none.
            source.wait_event(self._put[slot])
            base = self.buffers[slot].data_ptr()
            for offset, src, nbytes in copies:
                runtime.memcpyAsync(base + offset, src, nbytes, _MEMCPY_DEFAULT, handle)
            self._crossed[slot].record(source)
            self.stream.wait_event(self._crossed[slot])
            with torch.cuda.stream(self.stream):
                puts[slot].run()
            self._put[slot].record(self.stream)


def _landed(buffer: torch.Tensor, start: int, src: torch.Tensor) -> torch.Tensor:
    """The view of ``buffer`` from byte ``start`` shaped like contiguous ``src``."""
    return buffer[start : start + src.nbytes].view(src.dtype).view(src.shape)


def rounds(sources: Sequence[torch.device], targets: Sequence[torch.device]) -> list[torch.device]:
    """``sources`` in the order a reader on ``targets`` takes them: by ``s ^ d`` (``d`` the
    lowest target index), so on 2^k GPUs that all read from each other every round is a
    perfect matching, and nobody waits on a GPU that serves someone else."""
    first = min(t.index for t in targets)
    return sorted(sources, key=lambda s: (s.index ^ first, s.index))


class PeerCopies:
    """Copies that :func:`fits` allows, queued per source GPU (build once, :meth:`start` and
    :meth:`finish` every version: they hold addresses, which the views keep alive)."""

    def __init__(self, pairs: Sequence[Pair]) -> None:
        self.pairs = tuple(pairs)
        self._direct: dict[torch.device, list[tuple[int, int, int]]] = {}
        self._targets: dict[torch.device, set[torch.device]] = {}
        landed: dict[tuple[torch.device, torch.device], list[Pair]] = {}
        for dst, src in self.pairs:
            self._targets.setdefault(src.device, set()).add(dst.device)
            if dst.is_contiguous() and src.nbytes >= DIRECT_MIN_BYTES:
                copies = self._direct.setdefault(src.device, [])
                copies.append((dst.data_ptr(), src.data_ptr(), src.nbytes))
            else:
                landed.setdefault((src.device, dst.device), []).append((dst, src))
        for copies in self._direct.values():  # largest first: the small ones queue behind
            copies.sort(key=lambda copy: copy[2], reverse=True)
        self._landings = [_Landing(group) for group in landed.values()]
        # A stream of its own per source GPU: the current one there may be the legacy default
        # stream, whose handle (0) names the default stream of whichever GPU is current.
        self._streams = {device: torch.cuda.Stream(device) for device in self._targets}
        everywhere = {t for targets in self._targets.values() for t in targets}
        self._rounds = rounds(list(self._targets), list(everywhere))
        self._done = {device: torch.cuda.Event() for device in self._rounds}

    def start(self) -> None:
        """Queue every copy after what the sources' streams hold so far (a staged read waits
        for its bucket's packed event on the source GPU's stream); what writes a destination
        (a put, a direct copy) after what its stream holds too. Crossings into landing
        windows do not wait for the destinations, so the next bucket's bytes may cross while
        the destination GPU still puts the last one's in place and sums them."""
        cupy = copy_kernel.cupy()
        last = None
        for device in self._rounds:
            stream = self._streams[device]
            stream.wait_stream(torch.cuda.current_stream(device))
            if last is not None:  # the next round crosses once the last one has
                stream.wait_event(last)
            with cupy.cuda.Device(device.index):
                for landing in self._landings:  # first: the puts overlap what crosses next
                    if landing.source == device:
                        landing.start(cupy.cuda.runtime, stream)
                if device in self._direct:
                    for target in self._targets[device]:
                        stream.wait_stream(torch.cuda.current_stream(target))
                for dst, src, nbytes in self._direct.get(device, ()):
                    cupy.cuda.runtime.memcpyAsync(
                        dst, src, nbytes, _MEMCPY_DEFAULT, stream.cuda_stream
                    )
            last = self._done[device]
            last.record(stream)

    def finish(self) -> None:
        """Order the destinations' streams after the copies."""
        for device, targets in self._targets.items():
            for target in targets:
                torch.cuda.current_stream(target).wait_stream(self._streams[device])
        for landing in self._landings:
            torch.cuda.current_stream(landing.device).wait_stream(landing.stream)
