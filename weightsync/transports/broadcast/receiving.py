"""The receiver's end of the broadcast path: join the sender's group, land its buckets.

Buckets land in two buffers, alternating, so bucket i+1 arrives while bucket i is loaded. On
CUDA the loads run on a side stream and the transfers are issued from a receive stream of
their own: NCCL orders each collective after the stream it is issued from, so issuing it from
the current stream would hold the next transfer behind the previous load, and, on a receiver
registered with several senders, behind reads of another sender's buffers that wait for that
sender's packing, which waits for this sender's peers: a cycle across GPUs that hangs.
With deltas on (``receiver_delta_bytes``), a bucket's own bytes land in the buffer kept for
its index instead, and a delta lands in a landing buffer and is applied onto it
(:mod:`.bases`). The sender's end is :mod:`.sending`; the group itself :mod:`.group`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from weightsync.errors import TransportError, WeightSyncError
from weightsync.transports.broadcast.bases import AppliedBases
from weightsync.transports.broadcast.group import BroadcastGroup, GroupSpec, PendingBroadcast
from weightsync.v1 import weightsync_pb2 as pb


class BroadcastReceiver:
    """Joins the sender's broadcast group when told to and receives buckets announced in it."""

    def __init__(self, device: torch.device, delta_bytes: int = 0) -> None:
        self.device = device
        self.bases = AppliedBases(delta_bytes, device) if delta_bytes else None
        self.holds = 0
        """The version whose broadcast buckets ``bases`` holds, as applied (0: none)."""
        self._group: BroadcastGroup | None = None
        self._join_error: TransportError | None = None
        """Why the last join failed (the sender times out and fails this receiver too)."""
        self._landing = [torch.empty(0, dtype=torch.uint8, device=device)] * 2
        self._loaded: list[torch.cuda.Event | None] = [None, None]
        """Recorded on the side stream after the loads from each landing buffer."""
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._recv = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._allocated = 0

    @property
    def landings(self) -> int:
        """Landing (and kept) buffers allocated so far: views of one stay valid, and may be
        kept across versions, while this is unchanged."""
        return self._allocated + (self.bases.allocations if self.bases else 0)

    @property
    def failure(self) -> WeightSyncError | None:
        """Why the version of the bucket read last cannot apply here (a delta's base): its
        buckets still arrive, so the group stays in step, but none may be loaded."""
        return self.bases.error if self.bases else None

    def ended(self, end: pb.VersionEnd) -> None:
        """Raise :attr:`failure` if it is ``end``'s version's (before its end is checked)."""
        if self.bases and self.bases.error and self.bases.version == end.version:
            raise self.bases.error

    def join(self, join: pb.GroupJoin) -> None:
        """Join the group ``join`` names, leaving the previous one (runs on the pump thread)."""
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
            self._group = BroadcastGroup(spec, join.rank, self.device)
            self._join_error = None
        except TransportError as e:
            self._join_error = e

    @contextmanager
    def reading(self, msg: pb.BucketAnnouncement) -> Iterator[torch.Tensor | None]:
        """Everything that reads a bucket happens in here; yields the buffer a broadcast
        bucket landed in (None for a bucket that does not come by broadcast).

        Raises:
            TransportError: the bucket comes in a group this receiver did not join.
        """
        if not msg.group_id:
            yield None
            return
        group = self._group
        if group is None or group.spec.group_id != msg.group_id:
            raise TransportError(
                f"bucket {msg.layout.index} of version {msg.version} comes by broadcast in group "
                f"{msg.group_id}, which this receiver did not join"
                + (f" ({self._join_error})" if self._join_error else "")
            )
        which, bases, delta = msg.layout.index % 2, self.bases, msg.HasField("delta")
        self.holds, slot, fresh = 0, None, False
        if bases is not None:
            if bases.version != msg.version:
                self.synchronize()  # a failed version's loads may still read kept buffers
            bases.arrive(msg.version)
            before = bases.allocations
            slot = None if delta else bases.slot(msg.layout.index, msg.layout.nbytes)
            fresh = bases.allocations != before
        nbytes = msg.delta.nbytes if delta else msg.layout.nbytes
        landed, pending = self._receive(group, which, nbytes, slot, fresh)
        with self._loading(which, pending):
            if delta:
                if bases is None:
                    raise TransportError(
                        f"bucket {msg.layout.index} of version {msg.version} came as a delta, "
                        "which this receiver did not ask for (ReceiverHello.deltas)"
                    )
                landed = bases.decode(msg, landed)
            yield landed

    def applied(self, end: pb.VersionEnd) -> None:
        """The version ``end`` ends committed here: what landed becomes the next delta's base."""
        self.holds = end.version if self.bases and self.bases.applied(end) else 0

    def _receive(
        self,
        group: BroadcastGroup,
        which: int,
        nbytes: int,
        slot: torch.Tensor | None = None,
        fresh: bool = False,
    ) -> tuple[torch.Tensor, PendingBroadcast]:
        """Queue the transfer into ``slot`` (a kept buffer; ``fresh``: just allocated), else
        into landing buffer ``which`` once its previous loads are done."""
        if slot is not None:
            # A kept buffer's reads of the previous version ended with it (``synchronize``).
            if fresh and self._recv is not None:
                self._recv.wait_stream(torch.cuda.current_stream(self.device))
            return self._post(group, slot)
        if self._landing[which].numel() < nbytes:
            self.synchronize()  # the old buffer may still be read on the side stream
            self._landing[which] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._allocated += 1
            if self._recv is not None:
                self._recv.wait_stream(torch.cuda.current_stream(self.device))
        elif self._loaded[which] is not None and self._recv is not None:
            self._recv.wait_event(self._loaded[which])
        return self._post(group, self._landing[which][:nbytes])

    def _post(
        self, group: BroadcastGroup, into: torch.Tensor
    ) -> tuple[torch.Tensor, PendingBroadcast]:
        if self._recv is None:
            return into, group.broadcast(into)
        with torch.cuda.stream(self._recv):
            return into, group.broadcast(into)

    @contextmanager
    def _loading(self, which: int, pending: PendingBroadcast) -> Iterator[None]:
        """Reads after the transfer and (CUDA) on the side stream, whose progress frees the
        landing buffer for a later bucket."""
        if self._side is None:
            pending.wait()
            yield
            return
        with torch.cuda.stream(self._side):
            pending.wait()
            yield
            event = self._loaded[which] or torch.cuda.Event()
            event.record(self._side)
            self._loaded[which] = event

    def synchronize(self) -> None:
        """Wait for every load queued so far."""
        if self._side is not None:
            self._side.synchronize()

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
