"""Copies from another GPU's memory, pulled on the destination GPU's stream, when CuPy is
installed.

torch runs a copy across GPUs on the *source* GPU's current stream. A receiver reading its
peer's shard then queues its copies on the peer GPU, where the peer's own receiver (another
process, another context) queues its own: on 2 x H200, two 7.6 GB copies in opposite
directions took 38.5 ms that way against 19.5 ms with each issued by ``cudaMemcpy2DAsync`` on
its destination's stream (bench of 2026-11-23). A pull needs both views "pitched": rows of
contiguous bytes at a fixed stride (a whole tensor, or a box of a 2-D one, as a column shard
of a row-parallel weight is); others keep torch's copy.
"""

from __future__ import annotations

import functools
import os

import torch

_MEMCPY_DEFAULT = 4
"""cudaMemcpyDefault: the direction follows from the (unified) addresses."""


@functools.cache
def _runtime():
    if os.environ.get("WEIGHTSYNC_PEER_PULL", "1") == "0":
        return None
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def pitched(t: torch.Tensor) -> tuple[int, int, int] | None:
    """``(rows, row_bytes, pitch_bytes)`` of a view whose elements are rows of contiguous
    bytes ``pitch_bytes`` apart, or None."""
    merged: list[list[int]] = []  # [size, stride] from the innermost dim out
    for n, s in zip(reversed(t.shape), reversed(t.stride()), strict=True):
        if n == 1:
            continue
        if merged and s == merged[-1][0] * merged[-1][1]:
            merged[-1][0] *= n
        else:
            merged.append([n, s])
    size = t.element_size()
    if not merged:
        return 1, size, size
    if merged[0][1] != 1:
        merged.insert(0, [1, 1])  # rows of one element
    if len(merged) > 2:
        return None
    width = merged[0][0] * size
    rows, pitch = (merged[1][0], merged[1][1] * size) if len(merged) == 2 else (1, width)
    return (rows, width, pitch) if pitch >= width else None  # not rows that overlap


def _rows(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, int, int] | None:
    """``(rows, row_bytes, dst_pitch, src_pitch)`` copying ``src`` into ``dst`` row by row (a
    contiguous side takes the other's rows), or None."""
    d, s = pitched(dst), pitched(src)
    if d is None or s is None:
        return None
    if d[0] == 1 and s[0] > 1:
        d = (s[0], s[1], s[1])
    elif s[0] == 1 and d[0] > 1:
        s = (d[0], d[1], d[1])
    return (d[0], d[1], d[2], s[2]) if d[:2] == s[:2] else None


def can_pull(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether :class:`Pulls` copies ``src`` into ``dst``: two GPUs, rows of the same bytes."""
    if not (dst.is_cuda and src.is_cuda) or dst.device == src.device or _runtime() is None:
        return False
    if dst.dtype != src.dtype or dst.shape != src.shape or dst.nbytes == 0:
        return False
    return _rows(dst, src) is not None


class Pulls:
    """Copies :func:`can_pull` allows, pulled on a side stream of each destination GPU so they
    overlap the local copies queued meanwhile (build once: the addresses are kept, and the
    views that keep them alive; :meth:`start`, queue the rest, then :meth:`finish`)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs = tuple(pairs)
        self._rows = []
        for dst, src in self.pairs:
            rows, width, dpitch, spitch = _rows(dst, src)
            self._rows.append(
                (dst.device, dst.data_ptr(), dpitch, src.data_ptr(), spitch, width, rows)
            )
            _enable_peer(dst.device.index, src.device.index)
        self.devices = sorted({dst.device for dst, _ in self.pairs}, key=str)

    def start(self) -> None:
        cupy = _runtime()
        for device in self.devices:
            _side(device).wait_stream(torch.cuda.current_stream(device))
        for device, dst, dpitch, src, spitch, width, rows in self._rows:
            with cupy.cuda.Device(device.index):
                cupy.cuda.runtime.memcpy2DAsync(
                    dst,
                    dpitch,
                    src,
                    spitch,
                    width,
                    rows,
                    _MEMCPY_DEFAULT,
                    _side(device).cuda_stream,
                )

    def finish(self) -> None:
        """Order what comes after on each GPU's current stream behind the pulls."""
        for device in self.devices:
            torch.cuda.current_stream(device).wait_stream(_side(device))


@functools.cache
def _side(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@functools.cache
def _enable_peer(device: int, peer: int) -> None:
    """Let ``device`` read ``peer``'s memory directly (else the driver stages it)."""
    cupy = _runtime()
    with cupy.cuda.Device(device):
        if not cupy.cuda.runtime.deviceCanAccessPeer(device, peer):
            return
        try:
            cupy.cuda.runtime.deviceEnablePeerAccess(peer)
        except cupy.cuda.runtime.CUDARuntimeError as e:
            if "PeerAccessAlreadyEnabled" not in str(e):
                raise
