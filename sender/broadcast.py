"""The sender's end of the broadcast data path (the receivers' end: ``receiver/broadcast.py``).

One private group (``weightsync.transports.broadcast``) whose rank 0 is the sender and whose
other ranks are the receivers that get broadcasts; it is kept while its members and device
stay the same, and rebuilt otherwise. A broadcast that fails fails the broadcast receivers,
never the version: receivers that map the staging buffers go on.
"""

from __future__ import annotations

import threading

import torch

from weightsync.errors import TransportError
from weightsync.sender.outcomes import Outcomes
from weightsync.sender.records import VersionRun
from weightsync.sender.registry import Registry
from weightsync.sender.slots import Slot
from weightsync.transports.broadcast import BroadcastGroup, GroupSpec
from weightsync.v1 import weightsync_pb2 as pb


class SenderBroadcast:
    """Invites, connects and feeds the group; ``cond`` is the sender's lock (see ``outcomes.py``);
    ``registry`` says who gets broadcasts, ``outcomes`` fails them when the group does."""

    def __init__(
        self,
        store_host: str,
        timeout_s: float,
        cond: threading.Condition,
        registry: Registry,
        outcomes: Outcomes,
    ) -> None:
        self._store_host, self._timeout_s = store_host, timeout_s
        self._cond, self._registry, self._outcomes = cond, registry, outcomes
        self._group: BroadcastGroup | None = None
        self._members: tuple[str, ...] = ()
        self._device: torch.device | None = None
        self._invited: tuple[GroupSpec, object] | None = None
        """The group hosted but not yet built: its spec and rendezvous store."""

    @property
    def group_id(self) -> str:
        return self._group.spec.group_id if self._group else ""

    def invite(self, run: VersionRun, device: torch.device) -> None:
        """Send each broadcast receiver of ``run`` its join message if the group must be
        (re)built for them (lock held). A rendezvous that cannot be hosted fails them."""
        members = tuple(self._registry.broadcast_members(run))
        if not members or (members == self._members and device == self._device and self._group):
            return
        self.close()
        try:
            spec, store = BroadcastGroup.host(
                len(members) + 1, device, self._store_host, self._timeout_s
            )
        except TransportError as e:
            self._fail_members(run, e)
            return
        self._invited = (spec, store)
        self._members, self._device = members, device
        for rank, rid in enumerate(members, start=1):
            self._registry.receiver(rid).send(pb.Announcement(join=spec.join_message(rank)))

    def connect(self, run: VersionRun) -> None:
        """Build rank 0 of an invited group: blocks until every member joined (gloo), or fails
        them."""
        if self._invited is None:
            return
        (spec, store), self._invited = self._invited, None
        try:
            self._group = BroadcastGroup(spec, 0, self._device, store=store)
        except TransportError as e:
            self._members = ()
            self._fail_members(run, e)

    def send(self, run: VersionRun, slot: Slot, nbytes: int) -> None:
        """Queue the broadcast of the slot's bucket; packing into the slot again waits for it
        (:meth:`finish`)."""
        try:
            if self._group is None:
                raise TransportError("no broadcast group: its members failed to join")
            try:
                slot.broadcast = self._group.broadcast(slot.buffer.tensor[:nbytes])
            except TransportError:
                self.close()
                raise
        except TransportError as e:
            self._fail_members(run, e)

    def finish(self, run: VersionRun, slot: Slot) -> bool:
        """Wait for the slot's broadcast, if one is queued (NCCL: a stream wait only); returns
        whether one was."""
        work, slot.broadcast = slot.broadcast, None
        if work is None:
            return False
        try:
            work.wait()
        except TransportError as e:
            self.close()
            self._fail_members(run, e)
        return True

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._members, self._invited = None, (), None

    def _fail_members(self, run: VersionRun, error: TransportError) -> None:
        with self._cond:
            for rid in self._registry.broadcast_members(run):
                self._outcomes.fail(run, rid, error)
