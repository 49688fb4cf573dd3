"""The sender writing a receiver's weights itself (protocol §4.3).

A receiver on the GPU of the sender's staging offers its live tensors (``WriteOffer``: its
weights' storages and where each tensor lies in them, as a publisher offers its own) and, in
each verdict that names the offer, lets the sender write that version. The sender then writes
each staged bucket it packs into the receiver's weights and announces it ``written``: the
receiver reads nothing. Two processes' kernels on one GPU take turns (time slices, no MPS), so
a receiver loading on the GPU where the sender packs cost a third more than both passes in one
process (H200: two processes 19.7 ms, one 14.6 ms for 15.23 GB in 512 MiB buckets).

Where each of the bucket's tensors is one contiguous run in the receiver's weights, as in the
bucket, the pack's own launch writes them (``copy_sum_also``: the trainer's bytes read once,
written to the slot and the weights, summed once). Otherwise the sender copies the bucket from
the slot on its stream behind the pack, taking the checksum on the way where it can; each such
sum is compared with the pack's before the version's end goes out, and a receiver whose
weights differ fails.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from weightsync import limits, summed_copies, trace
from weightsync.buckets import Bucket
from weightsync.checksum import finish_all
from weightsync.errors import ChecksumError, ProtocolError, TransportError, WeightSyncError
from weightsync.regions import Pair, Region, region_copies
from weightsync.sender.packing import pack_bucket
from weightsync.sender.planner import MAP
from weightsync.sender.slots import Slot
from weightsync.sender.states import OutcomeState
from weightsync.summed_copies import Move, SummedCopies
from weightsync.transports import MappedBuffers
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import regions_from_pb

if TYPE_CHECKING:
    from weightsync.sender.records import ReceiverConn
    from weightsync.sender.version import Version

log = logging.getLogger("weightsync.sender")


@dataclass(frozen=True, eq=False)
class Offered:
    """A receiver's offered weights, mapped here: by tensor name, the boxes it keeps."""

    regions: Mapping[str, Sequence[Region]]
    device: torch.device
    buffers: MappedBuffers


def map_offer(offer: pb.WriteOffer, rid: str) -> Offered | None:
    """``offer`` mapped here, or None when it does not map (logged: that receiver then reads
    every bucket itself). Only CUDA IPC memory on one GPU is taken: never a path a client
    names, and each piece is checked to lie inside its storage."""
    try:
        limits.check_offer(offer)
        for i, handle in enumerate(offer.sources):
            if not handle.HasField("cuda_ipc"):
                raise ProtocolError(f"WriteOffer.sources[{i}] is not CUDA IPC memory")
        buffers = MappedBuffers()
        sources = [buffers.get(h) for h in offer.sources]
        devices = {s.device for s in sources}
        if len(devices) != 1:
            raise ProtocolError(f"WriteOffer spans {len(devices)} devices, not one")
        return Offered(regions_from_pb(offer.pieces, sources), devices.pop(), buffers)
    except (WeightSyncError, RuntimeError) as e:
        log.warning("receiver %s: its write offer is not taken (%s); it reads every bucket", rid, e)
        return None


@dataclass
class Writes:
    """One version's writes: the receivers that let the sender write it, and the checksum
    reductions of what was written, by (receiver, bucket index)."""

    granted: dict[str, Offered] = field(default_factory=dict)
    sums: dict[tuple[str, int], tuple[torch.Tensor, Bucket]] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    """Buckets written into each receiver's weights (``ReceiverOutcome.written_buckets``)."""

    def grant(self, version: Version, conn: ReceiverConn, verdict: pb.ManifestVerdict) -> None:
        """An accepting verdict: the receiver's offer named by ``writes_key`` is written into
        when it maps here and the receiver opens the staging buffers (lock held)."""
        if not verdict.writes_key or version.regions is None or version.transport != "cuda_ipc":
            return
        offered = conn.write_offers.get(verdict.writes_key)
        rid = conn.receiver_id
        if offered is not None and conn.data_path == MAP and rid not in version.sliced:
            self.granted[rid] = offered

    def pack(
        self, version: Version, bucket: Bucket, slot: Slot, staged: bool
    ) -> tuple[torch.Tensor | None, frozenset[str]]:
        """Pack ``bucket`` into ``slot`` (:func:`.packing.pack_bucket`) and, when it is a
        ``staged`` one (not a slice group's), write it into every receiver on the slot's GPU
        that lets the sender write it and still takes part: the first in the pack's own launch
        where the copies allow (each byte read once from the trainer, written to the slot and
        to the weights, summed once), the others from the slot behind it. A write from the
        slot that fails fails its receiver (``TransportError``), not the version. Returns the
        pack's checksum reduction (or None) and the receivers written."""
        with version.shared.cond:
            granted = [
                (rid, offered)
                for rid, offered in self.granted.items()
                if staged
                and version.outcomes[rid].state == OutcomeState.PENDING
                and str(offered.device) == slot.device
            ]
        fused: list[str] = []

        def also(pack: SummedCopies) -> SummedCopies | None:
            for rid, offered in granted:
                batch = _batch(slot, rid, offered, bucket, pack)
                if batch is not None:
                    fused.append(rid)
                    return batch
            return None

        sums = pack_bucket(version, bucket, slot, also if granted else None)
        if sums is None and granted:
            # The writes below sum the slot's padding too, and the sum taken apart after them
            # sees it zeroed (stale bytes of an earlier bucket failed the check).
            bucket.zero_gaps(slot.buffer.tensor)
        wrote = list(fused)
        for rid, offered in granted:
            batch = None if rid in fused else _batch(slot, rid, offered, bucket)
            if batch is None:
                continue
            try:
                written = batch.run()
            except RuntimeError as e:
                # That receiver's weights are half written; the others go on (a fault that
                # breaks the GPU fails the next pack, and with it the version).
                with version.shared.cond:
                    if version.outcomes[rid].state == OutcomeState.PENDING:
                        version.outcomes[rid].wrote = True
                        version.fail(
                            rid,
                            TransportError(
                                f"version {version.version}: writing bucket {bucket.index} "
                                f"into receiver {rid}'s weights failed: {e}"
                            ),
                        )
                continue
            if written is not None:
                self.sums[(rid, bucket.index)] = (written, bucket)
            wrote.append(rid)
        if wrote:
            self.counts.update(wrote)
            trace.mark("sender.wrote", index=bucket.index)
        return sums, frozenset(wrote)

    def differ(self, version: Version) -> list[tuple[str, ChecksumError]]:
        """The receivers still in ``version`` whose written bytes differ from the packed ones
        (its ``checksums``, by bucket index), each with its error; every write must be done."""
        checksums = version.checksums
        pending = set(version.active())
        keys = [k for k in self.sums if k[0] in pending]
        values = finish_all([self.sums[k][0] for k in keys], [self.sums[k][1].nbytes for k in keys])
        out = []
        for (rid, index), got in zip(keys, values, strict=True):
            if got != checksums[index]:
                bucket = self.sums[(rid, index)][1]
                first = bucket.entries[0].spec.name if bucket.entries else "-"
                out.append(
                    (
                        rid,
                        ChecksumError(
                            f"bucket {index} (first tensor {first!r}) as the sender wrote it "
                            f"into receiver {rid}'s weights sums to {got:#018x}, packed "
                            f"{checksums[index]:#018x}. Its weights were written: re-publish "
                            "to heal"
                        ),
                    )
                )
        return out


def _batch(
    slot: Slot, rid: str, offered: Offered, bucket: Bucket, pack: SummedCopies | None = None
) -> Any:
    """The copies that write ``bucket`` from ``slot`` into ``offered``, or with ``pack`` the
    pack's copies writing into ``offered`` too (:meth:`.SummedCopies.also`); None where they
    cannot be (some tensor of it is not offered; fused: a tensor not contiguous or cast, or
    not every byte written once). Worked out once per slot, bucket, offer and pack."""
    assert slot.copies is not None  # the pack made them
    key, tag = (rid, bucket.index, pack is not None), (offered, pack)
    kept = slot.copies.writes.get(key)
    if kept is not None and all(a is b for a, b in zip(kept[0], tag, strict=True)):
        return kept[1]
    buffer = slot.buffer.tensor
    pairs = []
    batch = None
    with torch.no_grad():
        for entry in bucket.entries:
            regions = offered.regions.get(entry.name)
            if regions is None:
                break
            pairs += [(live, staged) for staged, live in region_copies(buffer, entry, regions)]
        else:
            if pack is None:
                batch = summed_copies.copies(pairs, buffer, bucket.nbytes, destination=False)
            else:
                moves = _moves(pairs, buffer)
                batch = None if moves is None else pack.also(moves)
    slot.copies.writes[key] = (tag, batch)
    return batch


def _moves(pairs: Sequence[Pair], buffer: torch.Tensor) -> list[Move] | None:
    """``pairs`` (weight, staged view) as moves of bucket bytes (:data:`.summed_copies.Move`),
    or None where a pair is not the same bytes laid out alike on the buffer's device."""
    base = buffer.data_ptr()
    moves = []
    for live, staged in pairs:
        if not (live.is_contiguous() and staged.is_contiguous()):
            return None
        if live.dtype != staged.dtype or live.shape != staged.shape or live.device != buffer.device:
            return None
        if live.numel():
            moves.append((staged.data_ptr() - base, staged.nbytes, live.data_ptr()))
    return moves
