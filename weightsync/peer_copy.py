"""Copies from another GPU's memory, pulled on the destination GPU's stream, when CuPy is
installed.

torch runs a copy across GPUs on the *source* GPU's current stream. A receiver reading its
peer's shard then queues its copies on the peer GPU, where the peer's own receiver (another
process, another context) queues its own: on 2 x H200, two 7.6 GB copies in opposite
directions took 38.5 ms that way against 19.5 ms with each issued by ``cudaMemcpyAsync`` on
its destination's stream (2026-11-23). Contiguous copies only: a box (a column shard of a
row-parallel weight) is copied by torch into a temporary on the destination GPU and from there
into place; pulling its rows (``cudaMemcpy2DAsync``), or pulling it whole into a temporary on
the destination's current stream, made the node case 6-8x slower on H200 (not understood yet).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

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


def can_pull(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether :class:`Pulls` copies ``src`` into ``dst``: two GPUs, the same contiguous
    bytes."""
    return (
        dst.is_cuda
        and src.is_cuda
        and dst.device != src.device
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.nbytes > 0
        and _runtime() is not None
    )


def _memcpy(device, dst: int, peer, src: int, nbytes: int, stream: torch.cuda.Stream) -> None:
    cupy = _runtime()
    _enable_peer(device.index, peer.index)
    with cupy.cuda.Device(device.index):
        cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream.cuda_stream)


class Pulls:
    """Copies :func:`can_pull` allows, pulled on a side stream of each destination GPU so they
    overlap the local copies queued meanwhile (build once: the addresses are kept, and the
    views that keep them alive; :meth:`start`, queue the rest, then :meth:`finish`)."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs = tuple(pairs)
        self._copies = [
            (dst.device, dst.data_ptr(), src.device, src.data_ptr(), dst.nbytes)
            for dst, src in self.pairs
        ]
        self.devices = sorted({dst.device for dst, _ in self.pairs}, key=str)

    def start(self) -> None:
        for device in self.devices:
            _side(device).wait_stream(torch.cuda.current_stream(device))
        for device, dst, peer, src, nbytes in self._copies:
            _memcpy(device, dst, peer, src, nbytes, _side(device))

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
