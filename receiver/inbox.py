"""Where a receiver's broadcast buckets land.

Two buffers, alternating, so bucket i+1 arrives while bucket i is loaded. On CUDA the loads
run on a side stream: NCCL orders each collective after the *current* stream, so loading on
that stream would hold back the next transfer until the previous load finished.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from weightsync.transports.broadcast import BroadcastGroup, PendingBroadcast


class BroadcastInbox:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers = [torch.empty(0, dtype=torch.uint8, device=device)] * 2
        self._loaded: list[torch.cuda.Event | None] = [None, None]
        """Recorded on the side stream after the loads from each buffer."""
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: tuple[int, PendingBroadcast] | None = None

    def receive(self, group: BroadcastGroup, nbytes: int, index: int) -> torch.Tensor:
        """Queue the broadcast of bucket ``index`` into a free buffer; returns the buffer
        (read it only inside :meth:`loading`)."""
        which = index % 2
        if self._buffers[which].numel() < nbytes:
            self.synchronize()  # the old buffer may still be read on the side stream
            self._buffers[which] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        elif self._loaded[which] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loaded[which])
        view = self._buffers[which][:nbytes]
        self._pending = (which, group.broadcast(view))
        return view

    @contextmanager
    def loading(self) -> Iterator[None]:
        """Reads of the bucket just received go in here: after its transfer, and (CUDA) on the
        side stream, whose progress frees the buffer for a later bucket."""
        which, pending = self._pending
        self._pending = None
        if self._side is None:
            pending.wait()
            yield
            return
        with torch.cuda.stream(self._side):
            pending.wait()
            yield
            event = self._loaded[which] or torch.cuda.Event()
            event.record(self._side)
            self._loaded[which] = event

    def synchronize(self) -> None:
        """Wait for every load queued so far."""
        if self._side is not None:
            self._side.synchronize()
