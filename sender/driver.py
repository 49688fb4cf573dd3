"""The version driver: one thread runs the versions in turn (:meth:`Version.run`), and the
staging they share: the slots, sized for each version, claimed for its buckets and reused after
their last readers, and the one wait at a version's end for what its packing queued.

The thread is started once: a thread per version cost latency on every version.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial

import torch

from weightsync import trace
from weightsync.buckets import Bucket
from weightsync.checksum import row_sums
from weightsync.errors import SyncTimeoutError, TransportError, WeightSyncError
from weightsync.sender.announcements import Send, largest_bucket
from weightsync.sender.outcomes import Shared
from weightsync.sender.publisher_packs import PublisherPacks, StampPlaces
from weightsync.sender.records import RunAborted
from weightsync.sender.slots import Slot
from weightsync.sender.version import Version
from weightsync.transports import get_transport
from weightsync.transports.broadcast import SenderBroadcast
from weightsync.wire import error_to_pb

log = logging.getLogger("weightsync.sender")


class _Queued:
    """A version for the driver thread: its start already made by the thread that began it
    (``started`` set once it was), or left to the driver."""

    def __init__(
        self, version: Version, device: torch.device, inline: bool, stream: torch.cuda.Stream | None
    ) -> None:
        self.version, self.device, self.stream = version, device, stream
        self.started: threading.Event | None = threading.Event() if inline else None
        self._sends: list[Send] | BaseException = []

    def made(self, sends: list[Send] | BaseException) -> None:
        self._sends = sends
        self.started.set()

    def gpu(self) -> contextlib.AbstractContextManager:
        """Its GPU work on :attr:`stream` (a context per thread that enters it)."""
        return contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream)

    def sends(self) -> list[Send]:
        """What the inline start returned, or the exception it raised."""
        self.started.wait()
        if isinstance(self._sends, BaseException):
            raise self._sends
        return self._sends


class VersionDriver:
    """Runs versions one at a time, staged in ``shared.slots``, broadcast by ``broadcast``."""

    def __init__(self, shared: Shared, broadcast: SenderBroadcast) -> None:
        self.broadcast = broadcast
        self.stamp_places = StampPlaces()
        """Where publishers' packs are stamped, by layout, for every version's packs."""
        self._cond, self._settings, self._slots = shared.cond, shared.settings, shared.slots
        self._queued: queue.Queue[_Queued | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._idle = True
        """No version queued or being run (``_lock``)."""
        self._closed = False
        self._lock = threading.Lock()
        """Orders ``start`` and ``close``: nothing is queued behind the thread's end."""
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        """Where the versions' GPU work goes, per staging GPU (``_lock``)."""

    def start(self, version: Version, device: torch.device) -> None:
        """Run ``version``, staged on ``device``, after the versions started before it. When
        nothing is ahead of it and its staging buffers are in place, its start goes to the
        receivers from this thread (waking the driver thread for it cost latency).

        Raises:
            TransportError: the sender is shutting down (:meth:`close`).
        """
        with self._lock:
            if self._closed:
                raise TransportError(
                    "the sender is shutting down; publish the version again once it is back"
                )
            if self._thread is None:
                self._thread = threading.Thread(target=self._run_all, name="driver", daemon=True)
                self._thread.start()
            inline = self._idle and self._slots.fits(largest_bucket(version), device)
            item = _Queued(version, device, inline, self._stream(device))
            self._idle = False
            self._queued.put(item)
        if item.started is not None:
            try:
                with item.gpu():
                    sends = version.start(self, device)
            except BaseException as e:
                item.made(e)
            else:
                item.made(sends)

    def _stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The versions' GPU work on ``device`` goes to a stream of the sender's own, at high
        priority (``_lock`` held): on a trainer's stream (a sender in the trainer's process)
        its packs would queue behind the trainer's work, such as a quantization whose first
        launches they could follow (``publish(..., ready=...)``)."""
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device, priority=-1)
        return self._streams[device]

    def launch(self, version: Version, device: torch.device) -> None:
        """:meth:`start` (lock not held); a version that cannot start fails."""
        try:
            self.start(version, device)
        except TransportError as e:
            with self._cond:
                version.abort(error_to_pb(e))
        except Exception as e:
            log.exception("version %d: the driver did not start", version.version)
            with self._cond:
                version.abort(error_to_pb(WeightSyncError(f"{type(e).__name__}: {e}")))

    def close(self) -> None:
        """The driver thread ends after the version it runs; later versions fail to start."""
        with self._lock:
            self._closed = True
            self._queued.put(None)

    def _run_all(self) -> None:
        while (item := self._queued.get()) is not None:
            version, device = item.version, item.device
            inline = item.started is not None
            start = item.sends if inline else partial(version.start, self, device)
            try:
                with item.gpu():
                    version.run(self, device, start)
            except Exception as e:
                # A bug must fail its version, not every later one with the thread.
                log.exception("version %d: the driver failed", version.version)
                with self._cond:
                    version.abort(error_to_pb(WeightSyncError(f"{type(e).__name__}: {e}")))
            with self._lock:
                self._idle = self._queued.empty()

    # ---- the staging versions share (lock held unless said) ----

    def ensure_slots(self, version: Version, device: torch.device) -> None:
        """Slots on ``device`` that hold the largest bucket (reallocated once all are free)."""
        need = largest_bucket(version)
        self._slots.free_settled()
        if self._slots.fits(need, device):
            return
        what = "receivers to release staging buffers"
        self.wait(version, self._slots.all_free, self._settings.ack_timeout_s, what)
        for slot in self._slots.slots:
            self.before_reuse(slot, torch.device(slot.device), on_stream=False)
        self._slots.reallocate(need, device, get_transport(version.transport))

    def claim_slots(
        self,
        version: Version,
        issued: deque[tuple[Send, Slot]],
        todo: deque[Send],
        packs: PublisherPacks | None,
    ) -> None:
        """Give each free slot the next bucket of ``todo`` (waits for one if none is
        ``issued``); the publishers are asked to pack them when they pack (``packs``)."""
        with self._cond:
            if version.done:
                raise RunAborted()
            if not issued:
                index = todo[0].bucket.index
                what = f"staging buffer {self._slots.position(index)} to be free"
                free = partial(self._slots.free_for, index)
                self.wait(version, free, self._settings.ack_timeout_s + 5, what)
            fresh = []
            while todo and (slot := self._slots.claim(todo[0].bucket.index)) is not None:
                send = todo.popleft()
                issued.append((send, slot))
                fresh.append((send, slot))
                trace.mark("sender.issue", index=send.bucket.index)
        if packs is not None and fresh:
            packs.asked()
            for send, slot in fresh:
                # On CUDA the stamps queue behind the readers, and asking syncs once for both.
                device = torch.device(slot.device)
                self.before_reuse(slot, device, on_stream=device.type == "cuda")
                packs.ask(send.layout, slot)

    def before_reuse(self, slot: Slot, device: torch.device, on_stream: bool) -> None:
        """Order packing into ``slot`` after its last readers: by a stream wait on the GPU
        (``on_stream``: this process packs, or stamps the slot and syncs before publishers
        pack), else by waiting here."""
        broadcast = self.broadcast.finish(slot)
        events, slot.read_events = slot.read_events, []
        for read in events:
            if on_stream:
                torch.cuda.current_stream(device).wait_event(read.event)
            else:
                read.event.synchronize()
        if (broadcast or events) and not on_stream and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def packed(
        self,
        version: Version,
        bucket: Bucket,
        slot: Slot,
        device: torch.device,
        sums: torch.Tensor | None,
    ) -> None:
        """The bucket in ``slot`` is packed (queued, on CUDA): queue its checksum (unless the
        pack took it: ``sums``) and, on CUDA, record the event receivers' reads wait for."""
        if sums is None:
            bucket.zero_gaps(slot.buffer.tensor)  # its bytes depend on its tensors alone
            sums = row_sums(slot.buffer.tensor, bucket.nbytes)
        version.sums[bucket.index] = sums
        if slot.packed_event is not None:
            slot.packed_event[0].record(torch.cuda.current_stream(device))
        trace.mark("sender.checksum_queued", index=bucket.index)
        trace.gpu_mark("sender.gpu_packed", device, index=bucket.index)

    def drain(self, device: torch.device) -> None:
        """Every bucket is announced (lock not held): wait once for the broadcasts and the
        packing; after this the publishers' memory is no longer read."""
        for slot in self._slots.slots:
            self.broadcast.finish(slot)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        trace.flush_gpu()

    def wait(self, run: Version, ready: Callable[[], object], timeout_s: float, what: str) -> None:
        """Wait until ``ready()``; RunAborted once ``run`` is over."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if run.done:
                raise RunAborted()
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncTimeoutError(
                    f"version {run.version}: waited {timeout_s:.0f} s for {what}"
                )
            self._cond.wait(min(left, 1.0))
        if run.done:
            raise RunAborted()
