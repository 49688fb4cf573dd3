"""The receiver core every engine adapter reuses: subscribe, validate, map, verify, load, ack."""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import torch
from weightsync.receiver.inbox import BroadcastInbox
from weightsync.receiver.target import WeightTarget

from weightsync import trace
from weightsync.buckets import Bucket, BucketEntry, ChunkAssembler, entry_view
from weightsync.checksum import ALGORITHM, finish_all, row_sums
from weightsync.control.client import connect
from weightsync.errors import (
    ChecksumError,
    ProtocolError,
    ReceiverFailedError,
    SyncTimeoutError,
    TransportError,
    WeightSyncError,
)
from weightsync.manifest import VersionManifest
from weightsync.transports import MappedBuffers
from weightsync.transports.broadcast import BroadcastGroup, GroupSpec, host_id
from weightsync.transports.cuda_ipc import EventCache, device_uuid, new_event
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import (
    ManifestCache,
    ParseCache,
    bucket_from_pb,
    describe,
    error_to_pb,
)

_STREAM_CLOSED = object()
log = logging.getLogger("weightsync.receiver")


def _close_at_exit(ref: weakref.ref) -> None:
    receiver = ref()
    if receiver is not None:
        receiver.close(flush_timeout_s=2.0)


class ReceiverCore:
    """Subscribes ``target`` to the sender at ``address``; ``sync()`` applies versions.

    Registration happens in the constructor, so any version published afterwards is
    addressed to this receiver.

    Args:
        target: the engine adapter that validates and loads tensors.
        address: the sender's ``unix:/path`` or ``host:port``.
        engine, rank: how this receiver shows in ``weightsync status``.
        receiver_id: unique per engine worker (default: generated).
        verify_checksums: compare every bucket's checksum with the sender's before committing
            the version (computed on the device as buckets arrive).

    Raises:
        TransportError: no sender answers at ``address``.
    """

    def __init__(
        self,
        target: WeightTarget,
        address: str,
        *,
        engine: str = "torch",
        rank: int = 0,
        receiver_id: str | None = None,
        verify_checksums: bool = True,
        connect_timeout_s: float = 10.0,
        transports: tuple[str, ...] = ("shm", "cuda_ipc"),
    ) -> None:
        self.target = target
        self.address = address
        self.verify_checksums = verify_checksums
        self.applied_version = 0
        self.dirty = False
        """True when a failed version wrote some weights: they match no version until the next."""
        self.last_error: WeightSyncError | None = None
        self._buffers = MappedBuffers()
        self._events = EventCache()
        self._read_event: tuple[torch.cuda.Event, bytes] | None = None
        self._layouts = ParseCache(bucket_from_pb)
        self._manifests = ManifestCache()
        self._direct_views: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
        self._views: dict[tuple, tuple[list, list[BucketEntry]]] = {}
        self._validated: bytes | None = None
        """The last manifest (without version) the target accepted: the model's names and
        shapes do not change, so the same manifest need not be checked again."""
        self._group: BroadcastGroup | None = None
        self._landing = BroadcastInbox(target.device)
        self._inbox: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._lost = False
        self._connect_timeout_s = connect_timeout_s
        device = target.device
        trace.set_role("receiver")
        self._hello = pb.ReceiverHello(
            receiver_id=receiver_id or f"{engine}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
            engine=engine,
            rank=rank,
            device=str(device),
            device_uuid=device_uuid(device),
            transports=list(transports),
            host_id=host_id(),
        )
        self._register()
        self.receiver_id = self._hello.receiver_id
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()
        # A process that exits right after sync() must still deliver its last "applied".
        atexit.register(_close_at_exit, weakref.ref(self))

    def _register(self, timeout_s: float | None = None) -> None:
        """Open a Receive stream and register (again, after a sender restart, by the same id).

        Raises:
            TransportError: no sender answers, or it refused the registration.
        """
        channel, stub = connect(self.address, timeout_s or self._connect_timeout_s)
        requests: queue.Queue = queue.Queue()
        requests.put(pb.ReceiverMessage(hello=self._hello))
        stream = stub.Receive(iter(requests.get, None))
        try:
            first = next(stream)
        except grpc.RpcError as e:
            channel.close()
            raise TransportError(
                f"register with the sender at {self.address}: {e.details()}"
            ) from None
        self._hello.receiver_id = first.welcome.receiver_id
        old = getattr(self, "_channel", None)
        self._channel, self._requests, self._stream = channel, requests, stream
        if old is not None:
            old.close()

    def _pump(self) -> None:
        """Move announcements to the inbox; when the sender goes away, register again."""
        backoff_s = 0.5
        while True:
            try:
                for msg in self._stream:
                    trace.mark("receiver.arrived", kind=msg.WhichOneof("kind"))
                    if msg.WhichOneof("kind") == "join":
                        self._join(msg.join)
                    else:
                        self._inbox.put(msg)
                reason = "the sender ended the stream"
            except grpc.RpcError as e:
                reason = e.details() or str(e.code())
            if self._closed.is_set():
                return
            self._inbox.put((_STREAM_CLOSED, reason))
            log.warning(
                "receiver %s lost the sender at %s (%s); registering again",
                self._hello.receiver_id,
                self.address,
                reason,
            )
            while not self._closed.wait(backoff_s):
                try:
                    # Short tries: close() must find this thread between them, not inside
                    # a channel being set up (left there at exit, gRPC aborts the process).
                    self._register(timeout_s=min(self._connect_timeout_s, 1.0))
                    break
                except TransportError:
                    backoff_s = min(backoff_s * 2, 5.0)
            else:
                return
            backoff_s = 0.5
            log.warning("receiver %s registered again at %s", self.receiver_id, self.address)

    def _join(self, join: pb.GroupJoin) -> None:
        """Join the sender's broadcast group (here, so it never waits for ``sync()``)."""
        if self._group is not None:
            self._group.close()
            self._group = None
        spec = GroupSpec(
            join.group_id,
            join.store_host,
            join.store_port,
            join.world_size,
            join.backend,
            join.timeout_s,
        )
        try:
            self._group = BroadcastGroup(spec, join.rank, self.target.device)
        except TransportError as e:
            # The sender's side times out too and fails this receiver for the version.
            self.last_error = e

    def _next(self, deadline: float | None, waiting_for: str, in_version: bool) -> pb.Announcement:
        """The next announcement. Losing the sender fails a version in flight; between
        versions it only delays the next one (the pump registers again)."""
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                msg = self._inbox.get(timeout=left)
            except queue.Empty:
                raise SyncTimeoutError(
                    f"receiver {self.receiver_id}: no {waiting_for} in time"
                    + (f" (the sender at {self.address} is gone)" if self._lost else "")
                ) from None
            if not isinstance(msg, tuple):
                self._lost = False
                return msg
            self._lost = True
            if in_version:
                raise TransportError(
                    f"receiver {self.receiver_id}: lost the sender at {self.address} during "
                    f"a version: {msg[1]}"
                )

    def _send(self, **kind) -> None:
        if self._closed.is_set():
            raise ProtocolError(f"receiver {self.receiver_id} is closed")
        self._requests.put(pb.ReceiverMessage(**kind))

    def sync(self, timeout: float | None = None) -> int:
        """Apply the next version announced to this receiver and return it.

        Waits up to ``timeout`` seconds (None: forever) for a version to start.

        Raises:
            NameResolutionError, ManifestMismatchError: the manifest does not fit the model;
                nothing was written, the previous version stays.
            ChecksumError: a bucket arrived corrupted; ``dirty`` says whether weights changed.
            ReceiverFailedError: the sender gave up on this receiver for the version.
            TransportError: the sender went away.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        msg = self._next(deadline, "version", in_version=False)
        while msg.WhichOneof("kind") != "start":
            # Leftovers of a version already left.
            msg = self._next(deadline, "version", in_version=False)
        trace.mark("receiver.start")
        manifest, key = self._manifests(msg.start.manifest)
        try:
            if key != self._validated:
                self.target.validate(manifest)
                self._validated = key
        except Exception as e:
            error = _ours(e, f"validating version {manifest.version}")
            self._send(
                verdict=pb.ManifestVerdict(
                    version=manifest.version, accepted=False, error=error_to_pb(error)
                )
            )
            self.last_error = error
            if error is e:
                raise
            raise error from e
        self._send(verdict=pb.ManifestVerdict(version=manifest.version, accepted=True))
        return self._apply(manifest)

    def _apply(self, manifest: VersionManifest) -> int:
        version = manifest.version
        assembler = ChunkAssembler()
        reads = _VersionReads(version)
        touched = False  # did any write reach the model? (decides `dirty` on failure)
        index = -1
        try:
            self.target.begin(manifest)
            while True:
                msg = self._next(None, f"bucket of version {version}", in_version=True)
                kind = msg.WhichOneof("kind")
                trace.mark(f"receiver.{kind}", index=msg.bucket.layout.index)
                if kind == "bucket":
                    index = msg.bucket.layout.index
                    with self._reading(msg.bucket) as received:
                        tensors, chunks, buffers = self._bucket_tensors(
                            msg.bucket, assembler, reads, received
                        )
                        touched = True
                        self.target.load(tensors)
                        for entry, data in chunks:
                            self.target.load_chunk(entry, data)
                        read_event = self._after_reads(msg.bucket, buffers, reads)
                    trace.mark("receiver.queued", index=index)
                    self._send(
                        ack=pb.BucketAck(
                            version=version, index=index, ok=True, read_event=read_event
                        )
                    )
                elif kind == "end":
                    if assembler.pending:
                        raise ProtocolError(
                            f"version {version} ended with chunks missing for "
                            f"{assembler.pending[0]!r}"
                        )
                    self._wait(reads.devices)
                    self._landing.synchronize()
                    trace.mark("receiver.loaded", version=version)
                    reads.check(msg.end)
                    self.target.commit(manifest)
                    trace.mark("receiver.committed", version=version)
                    self._send(applied=pb.VersionApplied(version=version, ok=True))
                    self.applied_version, self.dirty, self.last_error = version, False, None
                    return version
                elif kind == "abort":
                    raise ReceiverFailedError(
                        f"the sender abandoned version {version} for receiver "
                        f"{self.receiver_id}: {describe(msg.abort.reason)}"
                    )
                else:
                    raise ProtocolError(f"unexpected {kind} inside version {version}")
        except Exception as e:
            # Whatever failed (an engine's loader raises its own types too), the target rolls
            # back what it can, `dirty` says whether weights changed, and the sender hears why
            # at once instead of waiting out its ack timeout.
            where = f"version {version}" + (f", bucket {index}" if index >= 0 else "")
            error = _ours(e, where)
            self.dirty = self.dirty or touched
            self.last_error = error
            try:
                self.target.abort(manifest, error)
            finally:
                if not isinstance(error, ReceiverFailedError) and not self._closed.is_set():
                    self._send(
                        applied=pb.VersionApplied(
                            version=version, ok=False, error=error_to_pb(error)
                        )
                    )
            if error is e:
                raise
            raise error from e

    def _bucket_tensors(
        self,
        msg: pb.BucketAnnouncement,
        assembler: ChunkAssembler,
        reads: _VersionReads,
        received: torch.Tensor | None,
    ) -> tuple[
        list[tuple[str, torch.Tensor]], list[tuple[BucketEntry, torch.Tensor]], list[torch.Tensor]
    ]:
        """What to load from a bucket, without writing anything yet: complete tensors (views
        where possible), chunks for targets that write them in place (``load_chunk``), and
        the buffers both read."""
        layout = msg.layout.SerializeToString()
        if msg.sources:
            sources = [self._buffers.get(h) for h in msg.sources]
            key = (layout, tuple(h.buffer_id for h in msg.sources))
            views = self._direct_views.get(key)
            if views is None:
                bucket = self._layouts(msg.layout, layout)
                views = [(e.name, entry_view(sources[e.source], e)) for e in bucket.entries]
                self._direct_views = {key: views}  # the latest layout is the one reused
            return views, [], sources
        bucket, buffer = self._bucket_buffer(msg, received, layout)
        if self.verify_checksums:
            reads.checksum(bucket, buffer)
        whole, chunked = self._staged_views(bucket, buffer, layout, cache=received is None)
        if hasattr(self.target, "load_chunk"):
            # The target writes chunks in place: no full-size temporary per oversized tensor.
            chunks = [(e, buffer[e.offset : e.offset + e.nbytes]) for e in chunked]
            return whole, chunks, [buffer]
        assembled = [(e.name, assembler.add(buffer, e)) for e in chunked]
        return whole + [(n, t) for n, t in assembled if t is not None], [], [buffer]

    def _staged_views(
        self, bucket: Bucket, buffer: torch.Tensor, layout: bytes, cache: bool
    ) -> tuple[list[tuple[str, torch.Tensor]], list[BucketEntry]]:
        """The bucket's whole tensors as views of ``buffer``, and its chunks. Mapped staging
        buffers live as long as their mapping, so their views are worked out once per
        (buffer, layout): building thousands of them (MoE experts) costs milliseconds every
        version. Broadcast buffers get fresh views (they are replaced when they grow)."""
        key = (buffer.data_ptr(), buffer.device, layout)
        cached = self._views.get(key) if cache else None
        if cached is None:
            whole = [(e.name, entry_view(buffer, e)) for e in bucket.entries if not e.is_chunked]
            cached = (whole, [e for e in bucket.entries if e.is_chunked])
            if cache:
                if len(self._views) >= 256:
                    self._views.clear()
                self._views[key] = cached
        return cached

    def _bucket_buffer(
        self, msg: pb.BucketAnnouncement, received: torch.Tensor | None, layout: bytes
    ) -> tuple[Bucket, torch.Tensor]:
        """Map the bucket's buffer (or take the one it was broadcast into); reads queued after
        this see the packed bytes."""
        bucket = self._layouts(msg.layout, layout)
        if received is not None:
            return bucket, received
        buffer = self._buffers.get(msg.buffer)
        if msg.ready_event and buffer.is_cuda:
            # Reads on another GPU are ordered after this stream by the cross-device copy.
            packed = self._events.get(msg.ready_event, buffer.device)
            try:
                torch.cuda.current_stream(buffer.device).wait_event(packed)
            except RuntimeError as e:
                raise TransportError(f"waiting for bucket {bucket.index} to be packed: {e}") from e
        return bucket, buffer

    @contextmanager
    def _reading(self, msg: pb.BucketAnnouncement) -> Iterator[torch.Tensor | None]:
        """Everything that reads a bucket happens in here; yields the buffer a broadcast
        bucket was received into (None for mapped buckets)."""
        if not msg.group_id:
            yield None
            return
        group = self._group
        if group is None or group.spec.group_id != msg.group_id:
            raise TransportError(
                f"bucket {msg.layout.index} of version {msg.version} comes by broadcast in group "
                f"{msg.group_id}, which this receiver did not join"
                + (f" ({self.last_error})" if self.last_error else "")
            )
        received = self._landing.receive(group, msg.layout.nbytes, msg.layout.index)
        with self._landing.loading():
            yield received

    def _after_reads(
        self, msg: pb.BucketAnnouncement, buffers: list[torch.Tensor], reads: _VersionReads
    ) -> bytes:
        """Make the bucket's buffer reusable; returns the event the sender waits for, if any.

        Direct reads come from trainer memory and broadcast buffers are our own: both finish
        here. A staging buffer on our own GPU is released by an event recorded behind the
        reads (no wait); other CUDA buffers by waiting for the reads.
        """
        devices = {b.device for b in buffers if b.is_cuda}
        if self.target.device.type == "cuda":
            devices.add(self.target.device)
        reads.devices |= devices
        if msg.sources:
            self._wait(devices)
        elif msg.ready_event and devices == {self.target.device}:
            if self._read_event is None:
                self._read_event = new_event(self.target.device)
            event, handle = self._read_event
            event.record(torch.cuda.current_stream(self.target.device))
            return handle
        elif not msg.group_id:
            self._wait(devices)
        return b""

    @staticmethod
    def _wait(devices: set[torch.device]) -> None:
        for device in devices:
            torch.cuda.current_stream(device).synchronize()

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Deliver pending acks, then leave: ending our stream lets the sender end its side."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._requests.put(None)
        self._pump_thread.join(flush_timeout_s)
        if self._group is not None:
            self._group.close()
        self._stream.cancel()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ours(error: BaseException, where: str) -> WeightSyncError:
    """``error`` itself when it is one of ours, else a WeightSyncError saying where and what."""
    if isinstance(error, WeightSyncError):
        return error
    return WeightSyncError(f"{where}: {type(error).__name__}: {error}")


class _VersionReads:
    """What one version's buckets left to finish: checksums queued behind the reads (compared
    with the sender's at the end) and the devices whose streams did the reading."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.devices: set[torch.device] = set()
        self._sums: list[tuple[Bucket, torch.Tensor]] = []

    def checksum(self, bucket: Bucket, buffer: torch.Tensor) -> None:
        self._sums.append((bucket, row_sums(buffer, bucket.nbytes)))

    def check(self, end: pb.VersionEnd) -> None:
        """Compare every bucket's checksum with the sender's (the reads must be done).

        Raises:
            ChecksumError: naming the first bucket that differs.
        """
        if not self._sums:
            return
        if end.checksum_algorithm != ALGORITHM:
            raise ChecksumError(
                f"unknown checksum algorithm {end.checksum_algorithm!r}; "
                f"this receiver knows {ALGORITHM}: upgrade weightsync"
            )
        values = finish_all([s for _, s in self._sums], [b.nbytes for b, _ in self._sums])
        for (bucket, _), got in zip(self._sums, values, strict=True):
            want = end.checksums[bucket.index] if bucket.index < len(end.checksums) else None
            if got != want:
                first = bucket.entries[0].name if bucket.entries else "-"
                announced = "none" if want is None else f"{want:#018x}"
                raise ChecksumError(
                    f"bucket {bucket.index} of version {self.version} (first tensor {first!r}, "
                    f"{bucket.nbytes} bytes) fails its checksum: got {got:#018x}, sender "
                    f"announced {announced}. Its weights were written: re-publish to heal"
                )
