"""What a broadcast receiver keeps to decode deltas (issue 36; protocol §5.1).

The bytes of each broadcast bucket as last applied, by bucket index, at most
``receiver_delta_bytes`` in all (docs/caches.md). A bucket's own bytes land straight in its kept
buffer (no copy); a delta lands in a landing buffer and is applied onto the kept bytes in place
(:func:`~weightsync.deltas.decode` checks the base's checksum and the result's). Once the
version commits, the receiver tells the sender it holds it (``VersionApplied.holds_base``) when
every broadcast bucket of it landed here; the sender sends deltas only then.

A version's first broadcast bucket checks every kept bucket against the checksum it was
applied with, so bytes that changed since (a planted fault, a stray write) fail the version
before any write reaches the model: its buckets still arrive (the group stays in step), none
loads, and it fails at its end naming the bucket; the sender then sends the next in full.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightsync.delta_wire import from_wire
from weightsync.deltas import checksum_of, decode
from weightsync.errors import WeightSyncError, WrongBaseError
from weightsync.v1 import weightsync_pb2 as pb


@dataclass
class _Kept:
    data: torch.Tensor
    version: int = 0
    """The version these bytes are of, as applied; 0: being replaced (a version in flight)."""
    checksum: int = 0


class KeptBuckets:
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
        for index, kept in sorted(self._kept.items()):
            got = checksum_of(kept.data) if kept.version else kept.checksum
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
                decode(delta, kept.data, base_version=kept.version, base_checksum=kept.checksum)
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
