"""The sender's side of the broadcast data path: one private group, rebuilt on membership change."""

from __future__ import annotations

import torch

from weightsync.errors import TransportError
from weightsync.transports.broadcast import BroadcastGroup, PendingBroadcast
from weightsync.v1 import weightsync_pb2 as pb


class Broadcaster:
    def __init__(self, store_host: str, timeout_s: float) -> None:
        self._store_host, self._timeout_s = store_host, timeout_s
        self._group: BroadcastGroup | None = None
        self._members: tuple[str, ...] = ()
        self._device: torch.device | None = None
        self._pending: tuple | None = None

    def invite(self, members: tuple[str, ...], device: torch.device) -> dict[str, pb.Announcement]:
        """Plan the group for ``members``; returns the join message each must get (maybe none).

        The group is kept while members and device stay the same.
        """
        if not members or (members == self._members and device == self._device and self._group):
            return {}
        self.close()
        spec, store = BroadcastGroup.host(
            len(members) + 1, device, self._store_host, self._timeout_s
        )
        self._pending = (spec, store)
        self._members, self._device = members, device
        return {
            rid: pb.Announcement(join=spec.join_message(rank))
            for rank, rid in enumerate(members, start=1)
        }

    def connect(self) -> None:
        """Build rank 0 of an invited group; blocks until every member joined (gloo)."""
        if self._pending is None:
            return
        (spec, store), self._pending = self._pending, None
        try:
            self._group = BroadcastGroup(spec, 0, self._device, store=store)
        except TransportError:
            self._members = ()
            raise

    @property
    def group_id(self) -> str:
        return self._group.spec.group_id if self._group else ""

    def broadcast(self, tensor: torch.Tensor) -> PendingBroadcast:
        """Queue the broadcast of ``tensor`` (see :meth:`BroadcastGroup.broadcast`)."""
        if self._group is None:
            raise TransportError("no broadcast group: its members failed to join")
        try:
            return self._group.broadcast(tensor)
        except TransportError:
            self.close()
            raise

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._members, self._pending = None, (), None
