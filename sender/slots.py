"""The staging slots: buffers a bucket is packed into and receivers read, reused in turn.

A slot is free again only when every receiver that maps it acked its bucket (queued its
reads). Packing into it again must then also wait for the work still reading it: each
receiver's CUDA read event and the bucket's broadcast (the version driver does that wait, see
``driver.py``). A failed receiver's reads are not waited for: if its process died, its event
might never complete.

Not thread-safe: every method is called with the sender's lock held.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from weightsync.regions import CopyBatch, Region
from weightsync.summed_copies import SummedCopies
from weightsync.transports import StagingBuffer, Transport
from weightsync.transports.base import transport_for_handle
from weightsync.transports.cuda_ipc import EventCache, new_event, release_event

if TYPE_CHECKING:
    from weightsync.sender.planner import TensorPlan
    from weightsync.transports.broadcast import QueuedBroadcast

OpenEvent = Callable[[bytes, torch.device], object]
"""Opens a receiver's read event from its interprocess handle."""


@dataclass(frozen=True)
class ReadEvent:
    """A receiver's CUDA event recorded after it queued its reads of a staging buffer."""

    receiver_id: str
    event: object


@dataclass
class PackCopies:
    """The sender's pack copies into one slot, by bucket index, for one (bucket plan, mapped
    regions, slice groups): cached objects, compared by identity (the same while layout, offer
    and receivers' boxes stay). Dropped with the slot, replaced when one changes."""

    plan: TensorPlan
    regions: Mapping[str, Sequence[Region]]
    slices: tuple
    """The version's slice groups (``slices.py``), whose buckets follow the plan's."""
    by_bucket: dict[int, CopyBatch | SummedCopies] = field(default_factory=dict)
    ready: dict[int, tuple[tuple[str, torch.cuda.Event], ...]] = field(default_factory=dict)
    """The events each bucket's pieces are written by (``Region.ready``), each with what it
    waits for, by bucket index."""
    writes: dict[tuple[str, int, bool], tuple[tuple, object]] = field(default_factory=dict)
    """The copies writing each bucket into a receiver's offered weights, by (receiver, bucket
    index, in the pack's launch), with the offer and pack they were worked out for
    (``writes.py``)."""


@dataclass
class Slot:
    """A staging buffer and the receivers that still read the bucket it holds."""

    buffer: StagingBuffer
    device: str
    packed_event: tuple[object, bytes] | None = None
    """CUDA staging: an interprocess event recorded once the bucket is packed, and its handle
    (receivers' reads wait for it)."""
    version: int = 0
    bucket_index: int = -1
    readers: set[str] = field(default_factory=set)
    """Receivers that have not acked the bucket (not even queued their reads)."""
    read_events: list[ReadEvent] = field(default_factory=list)
    """Receivers' queued reads, to finish before packing into the slot again."""
    broadcast: QueuedBroadcast | None = None
    """The bucket's broadcast, to finish before packing into the slot again."""
    packing: bool = False
    copies: PackCopies | None = None

    @property
    def free(self) -> bool:
        return not self.readers and not self.packing

    def announced(self, version: int, index: int, readers: set[str]) -> None:
        """The slot's bucket is packed and announced; ``readers`` map it."""
        self.packing, self.version, self.bucket_index = False, version, index
        self.readers = set(readers)


class SlotPool:
    """``num_buffers`` staging slots on one device, reallocated when a bucket outgrows them."""

    def __init__(
        self, num_buffers: int, bucket_size_bytes: int, open_event: OpenEvent | None = None
    ) -> None:
        self._num, self._cap = num_buffers, bucket_size_bytes
        self._open_event = open_event or EventCache().get
        """By default an EventCache: receivers' read events opened once by handle, kept for
        the sender's life (a receiver records into the same few events every version)."""
        self._slots: list[Slot] = []
        self._lent: list[tuple[Slot, Callable[[], bool]]] = []

    @property
    def slots(self) -> tuple[Slot, ...]:
        return tuple(self._slots)

    def all_free(self) -> bool:
        return all(s.free for s in self._slots)

    def position(self, index: int) -> int:
        """Which slot bucket ``index`` lands in (see :meth:`claim`)."""
        return index % len(self._slots)

    def free_for(self, index: int) -> bool:
        """Whether bucket ``index``'s slot is free."""
        return self._slots[self.position(index)].free

    def claim(self, index: int) -> Slot | None:
        """Bucket ``index``'s slot, now packing; None while it is packing or still read.

        A bucket lands in the same slot every version (slot ``index`` mod the slots): the
        sender's pack copies and each receiver's views and copies are worked out per buffer
        and kept, so a bucket that moved to the other slot had them all worked out again
        (MoE: ~10 ms a bucket; 3 versions in 20 took 2-23 times their usual 24 ms on H200).
        Acks come in bucket order, so the slot of bucket ``index - num_buffers`` is the one
        that frees first anyway; the first free slot was not always it (most likely when a
        version began while the last one's final bucket was still read)."""
        slot = self._slots[self.position(index)]
        if not slot.free:
            return None
        slot.packing, slot.readers = True, set()
        return slot

    def fits(self, need: int, device: torch.device) -> bool:
        """Whether every slot holds ``need`` bytes on ``device``."""
        return len(self._slots) == self._num and all(
            s.buffer.nbytes >= need and s.device == str(device) for s in self._slots
        )

    def reallocate(self, need: int, device: torch.device, transport: Transport) -> None:
        """Free every slot and allocate new ones of at least ``need`` bytes. Every slot must be
        free and its pending work finished."""
        self.close()
        # Round up so small growth does not reallocate every version.
        capacity = max(min(max(need, 1 << 20), self._cap), need)
        self._slots = [
            Slot(
                transport.allocate(capacity, device),
                str(device),
                packed_event=new_event(device) if device.type == "cuda" else None,
            )
            for _ in range(self._num)
        ]

    def release_reader(self, rid: str, version: int, index: int, read_event: bytes = b"") -> None:
        """Receiver ``rid`` queued its reads of bucket ``index``: packing into that slot again
        waits for ``read_event`` (empty: its reads are done).

        Raises:
            TransportError: the event does not open here.
        """
        for slot in self._slots:
            if slot.version == version and slot.bucket_index == index and rid in slot.readers:
                if read_event:
                    event = self._open_event(read_event, torch.device(slot.device))
                    slot.read_events.append(ReadEvent(rid, event))
                slot.readers.discard(rid)

    def forget_reader(self, rid: str) -> None:
        """Receiver ``rid`` failed: no slot waits for its ack or its reads any more."""
        for slot in self._slots:
            slot.readers.discard(rid)
            slot.read_events = [e for e in slot.read_events if e.receiver_id != rid]

    def release_version(self, version: int) -> None:
        """``version`` was abandoned: its buckets' slots are read by no one."""
        for slot in self._slots:
            if slot.version == version:
                slot.readers.clear()

    def lend(self, slot: Slot, settled: Callable[[], bool]) -> None:
        """``slot`` stays with publishers that may still write into it (their version ended
        before they packed): it leaves the pool, which allocates a replacement when next
        sized, and its buffer is freed once ``settled()`` (they packed or left)."""
        self._slots.remove(slot)
        self._lent.append((slot, settled))

    @property
    def lent(self) -> int:
        return len(self._lent)

    def free_settled(self) -> None:
        """Free the lent slots whose publishers are done with them."""
        keep = []
        for slot, settled in self._lent:
            if settled():
                _free(slot)
            else:
                keep.append((slot, settled))
        self._lent = keep

    def stop_packing(self) -> None:
        for slot in self._slots:
            slot.packing = False

    def close(self) -> None:
        """Free every slot's buffer and event (not the lent ones: :meth:`close_all`)."""
        for slot in self._slots:
            _free(slot)
        self._slots = []

    def close_all(self) -> None:
        """The sender stops: free every slot, lent ones too."""
        self.close()
        for slot, _ in self._lent:
            _free(slot)
        self._lent = []


def _free(slot: Slot) -> None:
    if slot.packed_event is not None:
        release_event(slot.packed_event[1])
    transport_for_handle(slot.buffer.handle).release(slot.buffer)
