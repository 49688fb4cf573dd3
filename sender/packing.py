"""The sender packing staged buckets itself, from the publishers' memory mapped here.

Used when the plan says the offered regions cover every staged tensor (``TensorPlan.
sender_packs``) and the memory maps here (CUDA IPC, or shm files whose open descriptors the
publisher passed with its begin: :func:`received_sources`); otherwise the publishers pack each
bucket when asked (``PackBucket``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from weightsync import limits, summed_copies
from weightsync.blocked_copies import BlockedCopies
from weightsync.buckets import Bucket
from weightsync.checksum import verify_copies
from weightsync.errors import ChecksumError, ProtocolError, TransportError, WeightSyncError
from weightsync.memo import Memo
from weightsync.regions import Region, region_copies
from weightsync.sender.offer import OfferKey
from weightsync.sender.slots import PackCopies, Slot
from weightsync.summed_copies import SummedCopies
from weightsync.transports import MappedBuffers
from weightsync.transports.cuda_ipc import EventCache, QueuedWork, named_events
from weightsync.transports.shm import map_descriptor, map_offered, without_descriptor
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import regions_from_pb

if TYPE_CHECKING:
    from weightsync.sender.version import Version

log = logging.getLogger("weightsync.sender")

Regions = Mapping[str, Sequence[Region]]


class MappedOffers:
    """Offered regions mapped here, by tensor name. Key: the :data:`OfferKey`; the last
    ``max_entries`` offers are kept with their mappings, one that does not map too (None,
    warned once: the publishers pack)."""

    def __init__(self, max_entries: int = 4) -> None:
        # An entry dropped (or cleared) is only dereferenced: its mappings go with their last
        # view (a run still packing from them keeps them).
        self._mapped: Memo[OfferKey, tuple[Regions | None, tuple]] = Memo(max_entries)

    def regions(self, key: OfferKey, begins: Mapping[int, pb.BeginVersion]) -> Regions | None:
        def mapped() -> tuple[Regions | None, tuple]:
            buffers, events = MappedBuffers(), EventCache()
            return _map(begins, buffers, events), (buffers, events)

        return self._mapped.get(key, mapped)[0]

    def clear(self) -> None:
        self._mapped.clear()


def received_sources(
    begin: pb.BeginVersion, fds: Sequence[int], rank: int
) -> tuple[torch.Tensor, ...]:
    """Map the ``shm`` sources of publisher ``rank``'s ``begin`` from the descriptors that came
    with it (``fds``: one per shm source, in the order of ``sources``, or none), renaming each
    source after its file (``shm.map_descriptor``) in ``begin``, which the sender keeps; a
    source without a usable descriptor is renamed so that it never maps (the publishers then
    pack). Returns the mappings, to hold while ``begin`` may be packed from. Closes ``fds``.

    Raises:
        ProtocolError: as many descriptors as shm sources, or none, must come.
        ConfigError: a source past its bounds (before it is renamed).
    """
    try:
        limits.check_count(begin.sources, "BeginVersion.sources", limits.MAX_SOURCES)
        for i, handle in enumerate(begin.sources):
            limits.check_buffer_handle(handle, f"BeginVersion.sources[{i}]")
        shm = [h for h in begin.sources if h.HasField("shm")]
        if fds and len(fds) != len(shm):
            raise ProtocolError(
                f"BeginVersion of version {begin.manifest.version} came with {len(fds)} "
                f"descriptor(s) for its {len(shm)} shm source(s); pass one per shm source, in "
                "the order of BeginVersion.sources, or none"
            )
        mapped = []
        for i, handle in enumerate(shm):
            path = handle.shm.path
            if not fds:
                handle.shm.path = without_descriptor(path)
                continue
            try:
                handle.shm.path, tensor = map_descriptor(fds[i], path, handle.nbytes)
            except TransportError as e:
                log.warning("publisher rank %d: %s; it packs instead", rank, e)
                handle.shm.path = without_descriptor(path)
            else:
                mapped.append(tensor)
        return tuple(mapped)
    finally:
        for fd in fds:
            os.close(fd)


def _map(
    begins: Mapping[int, pb.BeginVersion], buffers: MappedBuffers, events: EventCache
) -> Regions | None:
    regions: dict[str, list[Region]] = {}
    rank = -1
    try:
        for rank in sorted(begins):
            begin = begins[rank]
            # Never a path a client names: only files whose descriptors it passed.
            mapped = [
                map_offered(h) if h.HasField("shm") else buffers.get(h) for h in begin.sources
            ]
            ready = [events.get(h, _gpu_of(mapped, begin)) for h in begin.ready]
            for name, parts in regions_from_pb(begin.pieces, mapped, ready).items():
                regions.setdefault(name, []).extend(parts)
    except (TransportError, ProtocolError) as e:
        log.warning(
            "the publishers pack: publisher rank %d's offered memory does not map here (%s)",
            rank,
            e,
        )
        return None
    return regions


def _wait_ready(
    copies: PackCopies, bucket: Bucket, regions: Regions, timeout_s: float, what: str
) -> None:
    """Wait until the pieces of ``bucket`` still being written are written (the events of
    their ``SourcePiece.ready`` fired). Polled here, not waited for on the GPU: work that never ends
    in a publisher fails this version after ``timeout_s`` instead of blocking the sender's
    stream for every later one, and the events are mostly done long before their bucket's
    turn (a quantization outruns the link).

    Raises:
        SyncTimeoutError: naming ``what`` and a tensor whose event did not fire in time.
    """
    events = copies.ready.get(bucket.index)
    if events is None:
        pairs = ((e.name, r.ready) for e in bucket.entries for r in regions.get(e.name, ()))
        events = copies.ready[bucket.index] = named_events(pairs)
    if events:
        QueuedWork((), events).wait(timeout_s, what)


def _gpu_of(mapped: Sequence[torch.Tensor], begin: pb.BeginVersion) -> torch.device:
    """The GPU of a rank's offered memory, whose events its ``ready`` names.

    Raises:
        ProtocolError: it offered no CUDA memory.
    """
    gpu = next((t.device for t in mapped if t.is_cuda), None)
    if gpu is None:
        raise ProtocolError(
            f"the begin names {len(begin.ready)} ready event(s) but offers no CUDA memory; "
            "pieces in shared memory are written already"
        )
    return gpu


def pack_bucket(
    run: Version,
    bucket: Bucket,
    slot: Slot,
    also: Callable[[SummedCopies], SummedCopies | None] | None = None,
) -> torch.Tensor | None:
    """Queue the copies that pack ``bucket`` into ``slot`` from ``run.regions`` (set); returns
    the bucket checksum's reduction when the copies took it (:mod:`.summed_copies`), else None.
    ``also``: given fused pack copies, the same copies writing elsewhere too, run instead of
    them (None: the pack alone).

    Raises:
        TransportError: a copy failed.
        ChecksumError: a shared-memory slot does not hold what was copied into it (names the
            tensor).
    """
    # The copies' views are worked out once per (plan, regions, slices, slot, bucket): with
    # thousands of small tensors (MoE experts) building them cost more than the copies.
    copies = slot.copies
    if (
        copies is None
        or copies.plan is not run.tensors
        or copies.regions is not run.regions
        or copies.slices is not run.slices
    ):
        copies = slot.copies = PackCopies(run.tensors, run.regions, run.slices)
    buffer = slot.buffer.tensor
    what = f"version {run.version}, bucket {bucket.index} (packed by the sender)"
    try:
        batch = copies.by_bucket.get(bucket.index)
        if batch is None:
            pairs, names = [], []
            for entry in bucket.entries:
                # An empty tensor is covered by no piece at all: nothing to copy.
                for pair in region_copies(buffer, entry, run.regions.get(entry.name, ())):
                    pairs.append(pair)
                    names.append(entry.name)
            batch = copies.by_bucket[bucket.index] = summed_copies.copies(
                pairs, buffer, bucket.nbytes, destination=True, names=names
            )
        _wait_ready(copies, bucket, run.regions, run.shared.settings.pack_timeout_s, what)
        if isinstance(batch, BlockedCopies):
            # It sums the padding too: zeroed first, as for a bucket summed apart.
            bucket.zero_gaps(buffer)
            # Each piece is compared with its source right after its copy, still in cache.
            return batch.run(check=what)
        if also is not None and isinstance(batch, SummedCopies):
            batch = also(batch) or batch
        sums = batch.run()
    except ChecksumError:
        raise
    except (RuntimeError, WeightSyncError) as e:
        raise TransportError(
            f"version {run.version}: packing bucket {bucket.index} from the publishers' "
            f"memory failed: {e}"
        ) from e
    if not buffer.is_cuda:
        for entry in bucket.entries:
            regions = run.regions.get(entry.name, ())
            verify_copies(what, entry.name, region_copies(buffer, entry, regions))
    return sums
