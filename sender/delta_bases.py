"""What the sender keeps to send broadcast buckets as exact deltas (issue 36; protocol §5.1).

Per broadcast bucket index: the bytes it was last broadcast with, the version and the layout
they are of, and to whom. A bucket of the same layout goes as a delta from them when every
receiver of its group got them, said it decodes deltas (``ReceiverHello.deltas``) and holds
exactly that version (``VersionApplied.holds_base``, as
:class:`~weightsync.sender.records.ReceiverConn.holds` records it), and the delta is smaller
than the bucket (the codec chooses); else in full. The
bytes kept are bounded (``--delta-mb``, docs/caches.md); they live where the bucket was staged
(the staging GPU, or plain host memory for CPU staging), so diffing reads no host copy.

The driver's thread alone calls this (no lock): receivers' holdings are read under the lock
by the caller.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from weightsync.buckets import Bucket
from weightsync.delta_wire import element_bytes, to_wire
from weightsync.deltas import encode
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
        self._keep(_Base(version, key, packed, members), layout.index)
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
