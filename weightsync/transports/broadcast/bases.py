"""What the two ends of the broadcast path keep so a bucket may cross as an exact delta (issue 36;
protocol §5.1). Both are bounded (docs/caches.md) and off by default.

The sender (:class:`DeltaBases`) keeps, per broadcast bucket index, the bytes it last broadcast,
the version and layout they are of, and to whom. A bucket of the same layout goes as a delta
from them when every receiver of its group got them, said it decodes deltas
(``ReceiverHello.deltas``) and holds exactly that version (``VersionApplied.holds_base``), and
the delta is smaller than the bucket (the codec chooses); else in full. They live where the
bucket was staged (the staging GPU, or host memory for CPU staging), so diffing reads no host
copy. Only the sender's driver thread calls it (no lock).

The receiver (:class:`AppliedBases`) keeps each broadcast bucket's bytes as last applied. A
bucket's own bytes land straight in its kept buffer (no copy); a delta lands in a landing
buffer and is applied onto the kept bytes in place (:func:`~weightsync.deltas.decode` checks
the base's checksum and the result's). Once the version commits, the receiver says it holds it
when every broadcast bucket of it landed here. A version's first broadcast bucket checks every
kept bucket against the checksum it was applied with, so bytes that changed since (a planted
fault, a stray write) fail the version before any write reaches the model: its buckets still
arrive (the group stays in step), none loads, and it fails at its end naming the bucket; the
sender then sends the next in full.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from weightsync import trace
from weightsync.buckets import Bucket
from weightsync.checksum import finish_all, row_sums
from weightsync.delta_wire import element_bytes, from_wire, to_wire
from weightsync.deltas import decode, encode
from weightsync.errors import WeightSyncError, WrongBaseError
from weightsync.v1 import weightsync_pb2 as pb


@dataclass
class _Base:
    version: int
    layout: bytes
    data: torch.Tensor
    members: frozenset[str]
    """The receivers it was broadcast to: a receiver that held that version got it only
    if it was one of them (it may have been in another group then)."""


@dataclass(frozen=True)
class Encoded:
    """A bucket to broadcast as a delta: its announcement's fields and the payload."""

    msg: pb.BucketDelta
    payload: torch.Tensor


class DeltaBases:
    """The last broadcast bytes of each bucket, at most ``limit`` bytes in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._kept: dict[int, _Base] = {}

    def send(
        self,
        version: int,
        bucket: Bucket,
        layout: pb.BucketLayout,
        packed: torch.Tensor,
        members: frozenset[str],
        base: int,
    ) -> Encoded | None:
        """Keep ``packed`` (bucket ``layout.index`` of ``version``, broadcast to ``members``)
        as the next base; returns the delta to broadcast instead of it, made from the kept
        bytes of version ``base`` (0: the members do not all hold one version), or None:
        full bytes."""
        key = layout.SerializeToString()
        kept = self._kept.get(layout.index)
        out = None
        if (
            base
            and kept is not None
            and (kept.version, kept.layout) == (base, key)
            and members <= kept.members
        ):
            units = Counter()
            for e in bucket.entries:
                units[e.spec.torch_dtype.itemsize] += e.nbytes
            delta = encode(
                kept.data,
                packed,
                base_version=base,
                bucket=f"version {version}, bucket {layout.index}",
                element_bytes=element_bytes(units),
            )
            if delta.kind != "full":
                out = Encoded(*to_wire(delta))
            trace.mark("sender.delta_encoded", index=layout.index, kind=delta.kind)
        self._keep(_Base(version, key, packed, members), layout.index)
        trace.mark("sender.base_kept", index=layout.index)
        return out

    def _keep(self, new: _Base, index: int) -> None:
        packed, version = new.data, new.version
        kept = self._kept.pop(index, None)
        if kept is not None and kept.data.numel() == packed.numel():
            kept.data.copy_(packed)  # in place: no allocation once the layout settled
            self._kept[index] = _Base(version, new.layout, kept.data, new.members)
            return
        used = sum(b.data.numel() for b in self._kept.values())
        for old in sorted(self._kept, key=lambda i: self._kept[i].version):
            if used + packed.numel() <= self.limit or self._kept[old].version >= version:
                break
            used -= self._kept.pop(old).data.numel()  # an older version's bucket gives way
        if used + packed.numel() <= self.limit:
            self._kept[index] = _Base(version, new.layout, packed.clone(), new.members)


@dataclass
class _Kept:
    data: torch.Tensor
    version: int = 0
    """The version these bytes are of, as applied; 0: being replaced (a version in flight)."""
    checksum: int = 0


class AppliedBases:
    """Each broadcast bucket's last applied bytes on ``device``, ``limit`` bytes in all."""

    def __init__(self, limit: int, device: torch.device) -> None:
        self.limit, self.device = limit, device
        self._kept: dict[int, _Kept] = {}
        self.version = 0
        """The version whose broadcast buckets are arriving (or arrived last)."""
        self._landed: set[int] = set()
        self._complete = True
        """Every broadcast bucket of ``_version`` so far landed here (none over the bound)."""
        self.error: WeightSyncError | None = None
        """Why ``_version`` cannot apply here (its buckets still arrive, unloaded)."""
        self.allocations = 0
        """Kept buffers allocated so far (views of the landing buffers count them)."""

    def arrive(self, version: int) -> None:
        """A broadcast bucket of ``version`` arrives: the first of each version checks the
        kept bytes against their checksums before anything of it is written."""
        if version == self.version:
            return
        self.version, self._landed, self._complete, self.error = version, set(), True, None
        held = [(index, kept) for index, kept in sorted(self._kept.items()) if kept.version]
        sizes = [kept.data.numel() for _, kept in held]
        # Every kept bucket's checksum with one wait for the device, not one per bucket.
        sums = finish_all([row_sums(kept.data, kept.data.numel()) for _, kept in held], sizes)
        for (index, kept), got in zip(held, sums, strict=True):
            if got != kept.checksum:
                self.error = WrongBaseError(
                    f"bucket {index}: the bytes this receiver kept of it as applied in version "
                    f"{kept.version} changed since (checksum {got:#x}, applied "
                    f"{kept.checksum:#x}): version {version} fails here before any write; the "
                    "sender sends the next version's buckets in full"
                )
                self._forget()
                return

    def slot(self, index: int, nbytes: int) -> torch.Tensor | None:
        """Where bucket ``index``'s own bytes land: its kept buffer (None: not kept, over the
        bound or failed; this version is then not held)."""
        kept = self._kept.pop(index, None)
        if self.error is None and (kept is None or kept.data.numel() != nbytes):
            kept = None
            if sum(k.data.numel() for k in self._kept.values()) + nbytes <= self.limit:
                kept = _Kept(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
                self.allocations += 1
        if self.error is not None or kept is None:
            self._complete = False
            return None
        kept.version = 0
        self._kept[index] = kept
        self._landed.add(index)
        return kept.data

    def decode(self, msg: pb.BucketAnnouncement, payload: torch.Tensor) -> torch.Tensor | None:
        """Apply the delta ``payload`` carried (announced by ``msg``) onto the kept bytes of
        its bucket and return them; None when it cannot apply (``error`` says why)."""
        index = msg.layout.index
        name = f"bucket {index} of version {msg.version}"
        kept = self._kept.get(index)
        if self.error is None:
            try:
                if kept is None or not kept.version or kept.version != msg.delta.base_version:
                    held = f"version {kept.version}" if kept and kept.version else "no bytes"
                    raise WrongBaseError(
                        f"{name} came as a delta from version {msg.delta.base_version}, but this "
                        f"receiver holds {held} of it; the sender sends the next in full"
                    )
                delta = from_wire(msg.delta, payload, msg.layout.nbytes, name)
                trace.mark("receiver.delta_landed", index=index, kind=delta.kind)
                decode(delta, kept.data, base_version=kept.version, base_checksum=kept.checksum)
                trace.mark("receiver.delta_applied", index=index)
            except WeightSyncError as e:
                self.error = e
                self._forget()
        if self.error is not None or kept is None:
            self._complete = False
            return None
        kept.version = 0
        self._landed.add(index)
        return kept.data

    def applied(self, end: pb.VersionEnd) -> bool:
        """The version ``end`` ends committed: what landed here are its bytes. Returns whether
        every broadcast bucket of it did (``VersionApplied.holds_base``)."""
        if end.version != self.version or self.error is not None:
            return False
        for index in list(self._kept):
            if index in self._landed and index < len(end.checksums):
                self._kept[index].version = end.version
                self._kept[index].checksum = end.checksums[index]
            else:
                del self._kept[index]  # another version's: no delta will come for it
        return self._complete and bool(self._landed)

    def _forget(self) -> None:
        """Nothing kept holds a version any more: the next comes in full."""
        for kept in self._kept.values():
            kept.version = kept.checksum = 0
