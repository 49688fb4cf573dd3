"""Reading one bucket: map its buffer, view its tensors, order the reads, verify the bytes.

A bucket's bytes are in one of three places: a staging buffer the sender packed (shm or CUDA
IPC, mapped here once), the trainer's own memory (``sources``: the direct path, read in place)
or a landing buffer it was broadcast into (:mod:`.broadcast`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from weightsync.buckets import Bucket, BucketEntry, ChunkAssembler, TensorSpec, entry_view
from weightsync.checksum import ALGORITHM, Sums, finish_all, row_sums
from weightsync.errors import ChecksumError, ProtocolError, TransportError
from weightsync.receiver.target import Arrival, TensorBox, WeightTarget
from weightsync.topology_model import fits
from weightsync.transports import MappedBuffers
from weightsync.transports.cuda_ipc import EventCache, QueuedWork, new_event, wait_for_streams
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import ParseCache, bucket_from_pb

_MAX_CACHED_VIEWS = 256

Named = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class BucketViews:
    """A bucket's whole tensors as views of its buffer, its boxes of tensors (views too), and
    the entries that are chunks."""

    whole: Named
    boxed: list[tuple[BucketEntry, torch.Tensor]]
    chunked: list[BucketEntry]


@dataclass(frozen=True)
class BucketLoad:
    """One bucket's writes, worked out before any is made."""

    tensors: Named
    """Complete tensors: views of the buffer, or chunked tensors whose last chunk came."""
    chunks: list[tuple[BucketEntry, torch.Tensor]]
    """Chunks of tensors larger than a bucket, for a target that writes them in place."""
    buffers: list[torch.Tensor]
    """The buffers these read."""
    key: Hashable = None
    """Set when ``tensors`` and ``boxes`` are views of a mapped buffer's memory that are the
    same whenever the key repeats: the target may work out its writes once."""
    boxes: Sequence[TensorBox] = ()
    """Boxes of tensors: pieces of a sharded trainer's tensors, or what this rank keeps."""
    checksum: tuple[VersionReads, Bucket] | None = None
    """The bucket whose checksum (over ``buffers[0]``) the version's reads still need."""

    replaced: bool = False
    """The views of the reader's earlier keys are not coming again (:attr:`Arrival.replaced`)."""

    def write(self, target: WeightTarget) -> None:
        # The target may take the checksum in its copies when all of them read the buffer.
        summed = self.checksum is not None and self.key is not None and not self.boxes
        bucket = self.checksum[1] if self.checksum is not None else None
        sums = target.load(
            Arrival(
                self.tensors,
                self.boxes,
                self.chunks,
                self.key,
                self.replaced,
                self.buffers[0] if summed else None,
                bucket.nbytes if summed else 0,
            )
        )
        if self.checksum is not None:
            self.checksum[0].checksum(bucket, self.buffers[0], sums if summed else None)


class VersionReads:
    """What one version's buckets leave to finish: chunked tensors being reassembled,
    checksums queued behind the reads, and the devices whose streams did the reading."""

    def __init__(self, version: int, specs: Sequence[TensorSpec] = ()) -> None:
        self.version = version
        self.specs = specs
        self._by_name: dict[str, TensorSpec] | None = None
        self.assembler = ChunkAssembler()
        self.devices: set[torch.device] = set()
        self._sums: list[tuple[Bucket, Sums]] = []

    def box(self, entry: BucketEntry, data: torch.Tensor) -> TensorBox:
        """``data`` as the box of its tensor that ``entry`` says (:attr:`BucketEntry.box_start`).

        Raises:
            ProtocolError: the tensor is not in the version or the box does not fit in it.
        """
        if self._by_name is None:
            self._by_name = {spec.name: spec for spec in self.specs}
        spec = self._by_name.get(entry.name)
        start, size = entry.box_start, entry.spec.shape
        if spec is None or not fits(start, size, spec.shape):
            raise ProtocolError(
                f"version {self.version}: a box at {list(start)} of shape {list(size)} does "
                f"not fit {entry.name!r} ({'not in the version' if spec is None else spec.shape})"
            )
        return TensorBox(entry.name, spec.shape, start, data)

    def checksum(self, bucket: Bucket, buffer: torch.Tensor, sums: Sums | None) -> None:
        """Queue the bucket's checksum: ``sums`` when the loads took it, else a read of it."""
        self._sums.append((bucket, sums if sums is not None else row_sums(buffer, bucket.nbytes)))

    def require_complete(self) -> None:
        """Raises ProtocolError when a chunked tensor is still missing chunks."""
        if self.assembler.pending:
            raise ProtocolError(
                f"version {self.version} ended with chunks missing for "
                f"{self.assembler.pending[0]!r}"
            )

    def wait(self) -> None:
        """Wait for the reads queued on every device so far."""
        wait_for_streams(self.devices)

    def check(self, end: pb.VersionEnd) -> None:
        """Compare every bucket's checksum with the sender's (the reads must be done).

        Raises:
            ChecksumError: naming the first bucket that differs and its first tensor.
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


class BucketReader:
    """Works out what a bucket loads (:meth:`prepare`) and frees its buffer (:meth:`release`).

    Args:
        device: the target's device; reads are queued on its current stream.
        chunks_in_place: the target's :attr:`~.WeightTarget.chunks_in_place`.
        verify_checksums: queue a checksum behind every staged or broadcast bucket's reads
            (direct buckets are the trainer's memory: the sender computed nothing to compare).
    """

    def __init__(
        self, device: torch.device, *, chunks_in_place: bool, verify_checksums: bool
    ) -> None:
        self.device = device
        self.chunks_in_place = chunks_in_place
        self.verify_checksums = verify_checksums
        self._mapped = MappedBuffers()
        self._events = EventCache()
        self._layouts = ParseCache(bucket_from_pb)
        self._views: dict[Hashable, BucketViews] = {}
        """Views by (layout bytes or key, buffer ids or landing buffer): mapped buffers stay
        mapped and landing buffers are reused, so their views are built once, not every
        version (thousands of them for MoE experts cost ms)."""
        self._landed: set[Hashable] = set()
        """The keys in ``_views`` of landing buffers' views."""
        self._boxes: dict[Hashable, tuple[Sequence[TensorSpec], list[TensorBox]]] = {}
        """By ``_views`` key of a mapped bucket: its boxes, and the tensor list they were
        checked against."""
        self._forgot = False
        """Landing buffers' views were dropped since the last bucket prepared."""
        self._read_events: dict[str, tuple[torch.cuda.Event, bytes]] = {}
        """By staging buffer id (a few per sender, like the mapped buffers): recorded behind
        each of its buckets' reads (:meth:`_read_event`)."""
        self._ack_streams: dict[torch.device, torch.cuda.Stream] = {}
        """Per buffer GPU, where the read events are recorded."""

    def prepare(
        self, msg: pb.BucketAnnouncement, reads: VersionReads, landed: torch.Tensor | None
    ) -> BucketLoad:
        """What to load from the bucket, without writing anything to the model yet.

        ``landed``: the buffer a broadcast bucket was received into (None otherwise); its
        views are not cached, since landing buffers are replaced when they grow.
        """
        # A layout key names the layout and sources alike (cheaper than the layout's bytes).
        layout = ("key", msg.layout_key) if msg.layout_key else msg.layout.SerializeToString()
        if msg.sources:
            sources = [self._mapped.get(h) for h in msg.sources]
            key = (layout, tuple(h.buffer_id for h in msg.sources))
            views = self._views.get(key) or self._cache(
                key, self._view(self._layouts(msg.layout, layout), sources)
            )
            boxes = self._checked(key, views, reads)
            return BucketLoad(views.whole, [], sources, key, boxes, replaced=self._replaced())
        bucket = self._layouts(msg.layout, layout)
        buffer = landed if landed is not None else self._packed_buffer(msg, bucket)
        if landed is not None:
            # A landing buffer is reused for every bucket of its index until it is replaced
            # (the core then calls forget_landed): its views are kept like a mapped buffer's.
            key: Hashable = (layout, ("landed", landed.data_ptr()))
            self._landed.add(key)
        else:
            key = (layout, (msg.buffer.buffer_id,))
        views = self._views.get(key) or self._cache(key, self._view(bucket, [buffer]))
        whole = list(views.whole)
        boxes = [reads.box(entry, data) for entry, data in views.boxed]
        chunks = []
        for entry in views.chunked:
            # Chunks of a box are reassembled into the box first: a target that writes chunks
            # in place writes chunks of whole tensors.
            if self.chunks_in_place and not entry.box_start:
                chunks.append((entry, buffer[entry.offset : entry.offset + entry.nbytes]))
                continue
            done = reads.assembler.add(buffer, entry)
            if done is not None:
                if entry.box_start:
                    boxes.append(reads.box(entry, done))
                else:
                    whole.append((entry.name, done))
        # Only the kept views themselves may be loaded by key (not assembled tensors).
        kept = len(whole) == len(views.whole) and len(boxes) == len(views.boxed)
        checksum = (reads, bucket) if self.verify_checksums else None
        return BucketLoad(
            whole, chunks, [buffer], key if kept else None, boxes, checksum, self._replaced()
        )

    def forget_landed(self) -> None:
        """Drop the views of landing buffers (one was replaced; the old may be freed), and
        tell the target so with the next bucket (:attr:`BucketLoad.replaced`)."""
        for key in self._landed:
            self._views.pop(key, None)
        self._landed.clear()
        self._forgot = True

    def _replaced(self) -> bool:
        replaced, self._forgot = self._forgot, False
        return replaced

    def _checked(self, key: Hashable, views: BucketViews, reads: VersionReads) -> list[TensorBox]:
        """The boxes of a mapped bucket's views, checked once per manifest's tensor list (a
        direct bucket of a sharded trainer has hundreds, read every version)."""
        if not views.boxed:
            return []
        hit = self._boxes.get(key)
        if hit is None or hit[0] is not reads.specs:
            hit = self._boxes[key] = (reads.specs, [reads.box(e, d) for e, d in views.boxed])
        return hit[1]

    @staticmethod
    def _view(bucket: Bucket, sources: list[torch.Tensor]) -> BucketViews:
        whole, boxed = [], []
        for e in bucket.entries:
            if e.is_chunked:
                continue
            view = entry_view(sources[e.source], e)
            if e.box_start:
                boxed.append((e, view))
            else:
                whole.append((e.name, view))
        return BucketViews(whole, boxed, [e for e in bucket.entries if e.is_chunked])

    def _cache(self, key: Hashable, views: BucketViews) -> BucketViews:
        if len(self._views) >= _MAX_CACHED_VIEWS:
            self._views.clear()  # what repeats every version is back after one version
            self._landed.clear()
            self._boxes.clear()
        self._views[key] = views
        return views

    def _packed_buffer(self, msg: pb.BucketAnnouncement, bucket: Bucket) -> torch.Tensor:
        """Map the staging buffer; reads queued after this see the packed bytes."""
        buffer = self._mapped.get(msg.buffer)
        if msg.ready_event and buffer.is_cuda:
            # Reads on another GPU are ordered after this stream by the cross-device copy.
            packed = self._events.get(msg.ready_event, buffer.device)
            try:
                torch.cuda.current_stream(buffer.device).wait_event(packed)
            except RuntimeError as e:
                raise TransportError(f"waiting for bucket {bucket.index} to be packed: {e}") from e
        return buffer

    def release(
        self, msg: pb.BucketAnnouncement, load: BucketLoad, reads: VersionReads
    ) -> tuple[bytes, QueuedWork | None]:
        """Make the bucket's buffer reusable; returns the event the sender waits for, if any,
        and the reads to wait for before acking, if any.

        Direct reads come from trainer memory: they finish here. A staging buffer on one GPU
        (ours or another) read into our GPU is released by an event recorded behind the reads
        (no wait): :meth:`_read_event`. Other CUDA buffers (on several GPUs, read into host
        memory, or announced without a packed event) once the reads queued now are done (the
        caller may queue the next bucket's first). Landing buffers are our own
        (:mod:`.broadcast` orders their reuse).
        """
        homes = {b.device for b in load.buffers if b.is_cuda}
        devices = homes | ({self.device} if self.device.type == "cuda" else set())
        reads.devices |= devices
        if msg.sources:
            wait_for_streams(devices)
        elif msg.ready_event and self.device.type == "cuda" and len(homes) <= 1:
            home = next(iter(homes), self.device)
            return self._read_event(msg.buffer.buffer_id, home, devices), None
        elif not msg.group_id and devices:
            return b"", QueuedWork(devices)
        return b"", None

    def _read_event(self, buffer_id: str, home: torch.device, devices: set[torch.device]) -> bytes:
        """The handle of an interprocess event on the buffer's GPU (``home``), recorded behind
        every read of it queued so far on ``devices`` (reads into another GPU ordered in by a
        stream wait): the sender's stream waits for it before packing the buffer again, so
        neither process waits for the reads and the next buckets' packs and reads queue
        behind them (a receiver on another GPU waited for its reads before it acked: its host
        work per bucket then added to the GPUs'). One event per buffer: a record for the next
        bucket must not hold back the repacking of this one's. Recorded on a stream of its
        own: on the buffer's GPU's current stream, where the next bucket's crossings start
        (:meth:`~weightsync.peer_copies.PeerCopies.start`), the wait for our GPU would hold
        them behind this bucket's puts and sums (0.4-0.9 ms a bucket, 2 x H200)."""
        stream = self._ack_streams.get(home)
        if stream is None:
            stream = self._ack_streams[home] = torch.cuda.Stream(home)
        for device in devices:  # the buffer's GPU among them
            stream.wait_stream(torch.cuda.current_stream(device))
        if buffer_id not in self._read_events:
            self._read_events[buffer_id] = new_event(home)
        event, handle = self._read_events[buffer_id]
        event.record(stream)
        return handle
