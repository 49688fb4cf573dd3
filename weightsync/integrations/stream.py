"""Receive a version as a stream of ``(name, tensor)`` pairs, for frameworks whose own code
loads the weights into the engine (verl's checkpoint engines hand a generator to the rollout's
``update_weights``).

The receiver core runs the version in a worker thread against :class:`StreamTarget`; each
bucket's tensors are handed to the consumer and the bucket is acknowledged only once the
consumer asked for the next pair, so the views stay valid while the consumer copies them.
Checksums are compared at the version's end, after the last pair was consumed: a corrupted
bucket makes the stream raise ``ChecksumError`` at its end (the engine has loaded the bad
bytes, as with every weightsync receiver; the next version heals it).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Collection, Iterator

import torch

from weightsync.errors import NameResolutionError, WeightSyncError
from weightsync.manifest import VersionManifest
from weightsync.receiver.core import ReceiverCore
from weightsync.receiver.target import Arrival, WeightTarget

_LISTED = 5


class StreamClosed(WeightSyncError):
    """The consumer stopped reading the stream before the version's end."""


class StreamTarget(WeightTarget):
    """Hands every loaded bucket's tensors to a consumer and waits until it took them.

    Args:
        device: where bucket bytes are mapped or copied (the engine's device).
        expected_names: when given, a version with a name outside it is rejected before any
            byte moves (the engine's model names); None accepts any manifest (the engine's own
            loader then reports unknown names).
    """

    def __init__(self, device: torch.device, expected_names: Collection[str] | None = None):
        self.device = device
        self.expected_names = None if expected_names is None else frozenset(expected_names)
        self.items: queue.Queue = queue.Queue()
        self.taken = threading.Semaphore(0)
        self.closed = threading.Event()

    def validate(self, manifest: VersionManifest) -> None:
        if self.expected_names is None:
            return
        unknown = [t.name for t in manifest.tensors if t.name not in self.expected_names]
        if unknown:
            raise NameResolutionError(
                f"version {manifest.version}: {len(unknown)} tensor(s) the engine does not "
                f"expect, first {unknown[0]!r} (all: {unknown[:_LISTED]})"
            )

    def begin(self, manifest: VersionManifest) -> None:
        pass

    def load(self, arrival: Arrival) -> None:
        for tensors, _ in arrival.whole():
            if self.closed.is_set():
                raise StreamClosed("the consumer stopped reading the version's tensors")
            self.items.put(("tensors", list(tensors)))
            self.taken.acquire()
            if self.closed.is_set():
                raise StreamClosed("the consumer stopped reading the version's tensors")

    def commit(self, manifest: VersionManifest) -> None:
        pass

    def abort(self, manifest: VersionManifest, error: WeightSyncError) -> None:
        pass


class StreamReceiver:
    """A receiver whose versions come out as ``(name, tensor)`` streams.

    Registers with the sender at construction (versions published afterwards are addressed
    to it). Each :meth:`receive` (or :meth:`areceive`) applies exactly one version.

    Args:
        address: the sender's ``unix:/path`` or ``host:port``.
        device: the engine's device (default: the current CUDA device, else CPU).
        expected_names: see :class:`StreamTarget`.
        **kwargs: for :class:`~weightsync.receiver.core.ReceiverCore` (``engine``, ``rank``,
            ``receiver_id``, ``verify_checksums``, ...).

    Raises:
        TransportError: no sender answers at ``address``.
    """

    def __init__(
        self,
        address: str,
        *,
        device: torch.device | str | None = None,
        expected_names: Collection[str] | None = None,
        **kwargs,
    ) -> None:
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        self._expected = expected_names
        self._target = StreamTarget(self.device, expected_names)
        kwargs.setdefault("engine", "stream")
        self.core = ReceiverCore(self._target, address, **kwargs)
        self.receiver_id = self.core.receiver_id
        self.last_version = 0
        """The version the last completed stream applied."""

    def _start(self, timeout_s: float | None) -> StreamTarget:
        # A fresh target per version: a thread left behind by an abandoned stream keeps its own.
        target = StreamTarget(self.device, self._expected)
        self.core.target = target

        def run() -> None:
            try:
                target.items.put(("done", self.core.sync(timeout=timeout_s)))
            except BaseException as e:  # handed to the consumer
                target.items.put(("error", e))

        threading.Thread(target=run, name="weightsync-stream", daemon=True).start()
        return target

    def _taken(self, target: StreamTarget) -> None:
        # The consumer may have queued copies out of the views on its stream: finish them
        # before the bucket is acknowledged and its buffer reused.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        target.taken.release()

    def _finish(self, kind: str, payload) -> None:
        """The version's end: "done" records its version, anything else raises its error."""
        if kind != "done":
            raise payload
        self.last_version = payload

    @staticmethod
    def _close(target: StreamTarget) -> None:
        target.closed.set()
        target.taken.release()

    def receive(self, timeout_s: float | None = 600.0) -> Iterator[tuple[str, torch.Tensor]]:
        """Apply the next version, yielding its tensors as they arrive.

        Each tensor may be a view of a reused buffer, valid until the next pair is asked for:
        copy what you keep. Ends once the version is verified and reported applied.

        Raises:
            ChecksumError, NameResolutionError, SyncTimeoutError, TransportError: as
                ``ReceiverCore.sync``; the sender is told and the version fails.
        """
        target = self._start(timeout_s)
        finished = False
        try:
            while True:
                kind, payload = target.items.get()
                if kind != "tensors":
                    finished = True
                    self._finish(kind, payload)
                    return
                yield from payload
                self._taken(target)
        finally:
            if not finished:
                self._close(target)

    async def areceive(
        self, timeout_s: float | None = 600.0
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """:meth:`receive` for an event loop: waits for buckets off the loop."""
        target = self._start(timeout_s)
        finished = False
        try:
            while True:
                kind, payload = await asyncio.to_thread(target.items.get)
                if kind != "tensors":
                    finished = True
                    self._finish(kind, payload)
                    return
                for item in payload:
                    yield item
                self._taken(target)
        finally:
            if not finished:
                self._close(target)

    def close(self) -> None:
        self.core.close()
