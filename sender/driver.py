"""The version driver: one thread runs the versions in turn (:meth:`Version.run`), and the
staging they share: the slots, sized for each version and reused after their last readers,
and the end of a version, where its checksums are finished.

The thread is started once: a thread per version cost latency on every version.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from functools import partial

import torch

from weightsync import trace
from weightsync.checksum import ALGORITHM, finish_all
from weightsync.config import SenderSettings
from weightsync.errors import SyncTimeoutError, TransportError, WeightSyncError
from weightsync.metrics import SenderMetrics
from weightsync.sender.broadcast import SenderBroadcast
from weightsync.sender.outcomes import Outcomes
from weightsync.sender.records import RunAborted, VersionRun
from weightsync.sender.slots import Slot, SlotPool
from weightsync.sender.version import Send, Version
from weightsync.transports import get_transport
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import error_to_pb

log = logging.getLogger("weightsync.sender")


class _Queued:
    """A version for the driver thread: its start already made by the thread that began it
    (``started`` set once it was), or left to the driver."""

    def __init__(self, version: Version, device: torch.device, inline: bool) -> None:
        self.version, self.device = version, device
        self.started: threading.Event | None = threading.Event() if inline else None
        self._sends: list[Send] | BaseException = []

    def made(self, sends: list[Send] | BaseException) -> None:
        self._sends = sends
        self.started.set()

    def sends(self) -> list[Send]:
        """What the inline start returned, or the exception it raised."""
        self.started.wait()
        if isinstance(self._sends, BaseException):
            raise self._sends
        return self._sends


class VersionDriver:
    """Runs versions one at a time; ``cond`` is the sender's lock (see ``outcomes.py``)."""

    def __init__(
        self,
        cond: threading.Condition,
        settings: SenderSettings,
        metrics: SenderMetrics,
        outcomes: Outcomes,
        slots: SlotPool,
        broadcast: SenderBroadcast,
    ) -> None:
        self.cond, self.settings, self.metrics = cond, settings, metrics
        self.outcomes, self.slots, self.broadcast = outcomes, slots, broadcast
        self._queued: queue.Queue[_Queued | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._idle = True
        """No version queued or being run (``_lock``)."""
        self._closed = False
        self._lock = threading.Lock()
        """Orders ``start`` and ``close``: nothing is queued behind the thread's end."""

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
            inline = self._idle and self.slots.fits(version.largest_bucket(), device)
            item = _Queued(version, device, inline)
            self._idle = False
            self._queued.put(item)
        if item.started is not None:
            try:
                sends = self._start(version, device)
            except BaseException as e:
                item.made(e)
            else:
                item.made(sends)

    def close(self) -> None:
        """The driver thread ends after the version it runs; later versions fail to start."""
        with self._lock:
            self._closed = True
            self._queued.put(None)

    def _run_all(self) -> None:
        while (item := self._queued.get()) is not None:
            version, device = item.version, item.device
            inline = item.started is not None
            start = item.sends if inline else partial(self._start, version, device)
            try:
                version.run(self, device, start)
            except Exception as e:
                # A bug must fail its version, not every later one with the thread.
                log.exception("version %d: the driver failed", version.version)
                with self.cond:
                    self.outcomes.abort(
                        version, error_to_pb(WeightSyncError(f"{type(e).__name__}: {e}"))
                    )
            with self._lock:
                self._idle = self._queued.empty()

    def _start(self, version: Version, device: torch.device) -> list[Send]:
        """The version's start, from whichever thread makes it."""
        return version.start(self, device)

    # ---- the staging versions share (lock held unless said) ----

    def ensure_slots(self, version: Version, device: torch.device) -> None:
        """Slots on ``device`` that hold the largest bucket (reallocated once all are free)."""
        need = version.largest_bucket()
        if self.slots.fits(need, device):
            return
        what = "receivers to release staging buffers"
        self.wait(version, self.slots.all_free, self.settings.ack_timeout_s, what)
        for slot in self.slots.slots:
            self.before_reuse(slot, torch.device(slot.device), on_stream=False)
        self.slots.reallocate(need, device, get_transport(version.transport))

    def before_reuse(self, slot: Slot, device: torch.device, on_stream: bool) -> None:
        """Order packing into ``slot`` after its last readers: by a stream wait when this
        process packs on the GPU (``on_stream``), else by waiting here (a publisher packs in
        its own process)."""
        broadcast = self.broadcast.finish(slot)
        events, slot.read_events = slot.read_events, []
        for read in events:
            if on_stream:
                torch.cuda.current_stream(device).wait_event(read.event)
            else:
                read.event.synchronize()
        if (broadcast or events) and not on_stream and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def end(self, version: Version, device: torch.device) -> None:
        """Every bucket is announced (lock not held): wait once for the packing (after this,
        the publishers' memory is no longer read), then :meth:`send_end`."""
        for slot in self.slots.slots:
            self.broadcast.finish(slot)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        trace.flush_gpu()
        with self.cond:
            self.send_end(version)

    def send_end(self, version: Version) -> None:
        """Every receiver still in ``version`` gets its end, with every bucket's checksum; they
        commit after checking theirs."""
        sent = [s.bucket for s in version.sends()]
        values = dict(
            zip(
                [b.index for b in sent],
                finish_all([version.sums[b.index] for b in sent], [b.nbytes for b in sent]),
                strict=True,
            )
        )
        # By index; 0 for the staged buckets nobody took (every receiver in a slice group).
        checksums = [values.get(i, 0) for i in range(max(values, default=-1) + 1)]
        end = pb.Announcement(
            end=pb.VersionEnd(
                version=version.version, checksum_algorithm=ALGORITHM, checksums=checksums
            )
        )
        self.outcomes.address(version, "applied", lambda c: end)

    def wait(
        self, run: VersionRun, ready: Callable[[], object], timeout_s: float, what: str
    ) -> None:
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
            self.cond.wait(min(left, 1.0))
        if run.done:
            raise RunAborted()
