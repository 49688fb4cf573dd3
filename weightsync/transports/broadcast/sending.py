"""The sender's end of the broadcast path (the receivers' end: :mod:`.receiving`).

Private groups (:mod:`.group`) whose rank 0 is the sender and whose other ranks are receivers
that get broadcasts; they are kept while their members, the members' streams and the device
stay the same and no member failed a version by a transport error, and rebuilt otherwise
(:func:`in_step`). A broadcast that fails fails its group's receivers, never the version:
receivers that map the staging buffers, and the other groups, go on. With ``--delta-mb``, a
bucket whose group holds its previous bytes goes as a delta (:class:`.bases.DeltaBases`).

Which receivers get broadcasts is the sender's to say (``members_of``); what this end needs of
a version, a receiver's stream and a staging slot are the protocols below.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from weightsync.buckets import Bucket
from weightsync.errors import TransportError
from weightsync.transports.base import StagingBuffer
from weightsync.transports.broadcast.bases import DeltaBases, Encoded
from weightsync.transports.broadcast.group import BroadcastGroup, GroupSpec, PendingBroadcast
from weightsync.v1 import weightsync_pb2 as pb

Members = tuple[str, ...]
"""The receivers of one group, in rank order (rank 0 is the sender)."""


@dataclass
class WireCount:
    """What one version broadcast (``VersionStatus.broadcast_bytes`` and ``delta_buckets``)."""

    nbytes: int = 0
    deltas: int = 0

    def sent(self, nbytes: int, delta: bool) -> None:
        self.nbytes += nbytes
        self.deltas += delta


class Member(Protocol):
    """A receiver's stream, as the sender registered it (``ReceiverConn``)."""

    broadcast_failed: bool
    deltas: bool
    holds: int

    def send(self, msg: pb.Announcement) -> None: ...


class Group(Protocol):
    members: Members


class Run(Protocol):
    """A version being sent (``sender.version.Version``)."""

    version: int
    audience: frozenset[str] | None
    """Set for a catch-up (sent to some receivers only)."""
    slices: Sequence[Group]
    wire: WireCount

    @property
    def sliced(self) -> frozenset[str]: ...

    def active(self) -> Iterable[str]: ...

    def fail(self, receiver_id: str, error: TransportError) -> None: ...


class Slot(Protocol):
    buffer: StagingBuffer
    broadcast: QueuedBroadcast | None


class QueuedBroadcast(NamedTuple):
    """A slot's bucket being broadcast: for which version, to which group, the pending work.

    It may be finished only after a later version rebuilt the same members' group (a version
    that every receiver failed ends without waiting for its broadcasts): its failure then
    concerns its own version and group, never the new ones."""

    run: Run
    members: Members
    pending: PendingBroadcast
    payload: torch.Tensor | None = None
    """A delta's encoded bytes, alive until the broadcast is done."""


class SenderBroadcast:
    """Invites, connects and feeds the groups; ``cond`` is the sender's lock (see
    ``outcomes.Shared``); ``members_of`` says which of a version's receivers get broadcasts,
    ``stream`` gives a receiver's stream by id; a group that fails fails its members in their
    version.

    One group for the broadcast receivers that get the staged buckets, and one per slice group
    (``slices.py``: receivers that keep the same boxes get buckets of those boxes)."""

    def __init__(
        self,
        store_host: str,
        timeout_s: float,
        cond: threading.Condition,
        members_of: Callable[[Run], list[str]],
        stream: Callable[[str], Member],
        delta_bytes: int = 0,
    ) -> None:
        self._store_host, self._timeout_s = store_host, timeout_s
        self._cond, self._members_of, self._stream = cond, members_of, stream
        self._bases = DeltaBases(delta_bytes) if delta_bytes else None
        """The last broadcast bytes of each bucket, to send the next as deltas (0: off)."""
        self._groups: dict[Members, BroadcastGroup | None] = {}
        """Each group by its members; None until built (or when it failed)."""
        self._joined: dict[Members, tuple[Member, ...]] = {}
        """Each group's members' streams (registrations) when it was hosted."""
        self._device: torch.device | None = None
        self._invited: list[tuple[Members, GroupSpec, object]] = []
        """The groups hosted but not yet built: their members, spec and rendezvous store."""

    def group_id(self, members: Members) -> str:
        group = self._groups.get(members)
        return group.spec.group_id if group else ""

    def staged_members(self, run: Run) -> Members:
        """The group of ``run``'s broadcast receivers in no slice group: they get the staged
        buckets (lock held)."""
        return tuple(r for r in self._members_of(run) if r not in run.sliced)

    def groups_of(self, run: Run) -> list[Members]:
        """The groups ``run`` needs: :meth:`staged_members`, then each slice group's."""
        return [m for m in (self.staged_members(run), *(g.members for g in run.slices)) if m]

    def invite(self, run: Run, device: torch.device) -> None:
        """Send each broadcast receiver of ``run`` its join message if its group must be
        (re)built (lock held). A rendezvous that cannot be hosted fails the group's members."""
        wanted = self.groups_of(run)
        kept = all(
            self._groups.get(m) is not None and in_step(self._joined[m], self._streams(m))
            for m in wanted
        )
        if set(wanted) == set(self._groups) and device == self._device and kept:
            return
        self.close()
        self._device = device
        for members in wanted:
            try:
                spec, store = BroadcastGroup.host(
                    len(members) + 1, device, self._store_host, self._timeout_s
                )
            except TransportError as e:
                self._fail(run, members, e)
                continue
            self._groups[members] = None
            self._joined[members] = self._streams(members)
            for conn in self._joined[members]:
                conn.broadcast_failed = False
            self._invited.append((members, spec, store))
            for rank, rid in enumerate(members, start=1):
                self._stream(rid).send(pb.Announcement(join=spec.join_message(rank)))

    def connect(self, run: Run) -> None:
        """Build rank 0 of every invited group: blocks until each member joined (gloo), or
        fails them."""
        invited, self._invited = self._invited, []
        for members, spec, store in invited:
            try:
                self._groups[members] = BroadcastGroup(spec, 0, self._device, store=store)
            except TransportError as e:
                self._groups.pop(members, None)
                self._fail(run, members, e)

    def encode(
        self, run: Run, group: Group | None, bucket: Bucket, layout: pb.BucketLayout, slot: Slot
    ) -> Encoded | None:
        """The bucket packed in ``slot`` as a delta for its broadcast group (``group``, or
        None: the staged buckets'), or None: its own bytes. A delta needs every member to
        decode deltas and hold the bytes kept of this bucket; a catch-up (``audience``) is
        sent, and kept, as it is."""
        if self._bases is None or run.audience is not None:
            return None
        with self._cond:
            members = group.members if group else self.staged_members(run)
            held = {c.holds if c.deltas else 0 for c in self._streams(members)}
        if not members:
            return None  # nobody gets it by broadcast: nothing to keep it for
        base = held.pop() if len(held) == 1 else 0
        packed = slot.buffer.tensor[: bucket.nbytes]
        return self._bases.send(run.version, bucket, layout, packed, frozenset(members), base)

    def send(
        self, run: Run, slot: Slot, nbytes: int, members: Members, delta: Encoded | None
    ) -> None:
        """Queue the broadcast of the slot's bucket (or its ``delta``) to ``members``' group;
        packing into the slot again waits for it (:meth:`finish`)."""
        group = self._groups.get(members)
        try:
            if group is None:
                raise TransportError(
                    f"no broadcast group for {group_name(run, members)}: its members failed to join"
                )
            try:
                data = slot.buffer.tensor[:nbytes] if delta is None else delta.payload
                pending = group.broadcast(data)
                slot.broadcast = QueuedBroadcast(run, members, pending, data)
                run.wire.sent(data.numel(), delta is not None)
            except TransportError:
                self._close(members)
                raise
        except TransportError as e:
            self._fail(run, members, e)

    def finish(self, slot: Slot) -> bool:
        """Wait for the slot's broadcast, if one is queued (NCCL: a stream wait only); returns
        whether one was."""
        queued, slot.broadcast = slot.broadcast, None
        if queued is None:
            return False
        try:
            queued.pending.wait()
        except TransportError as e:
            if self._groups.get(queued.members) is queued.pending.group:
                self._close(queued.members)
            self._fail(queued.run, queued.members, e)
        return True

    def close(self) -> None:
        for members in list(self._groups):
            self._close(members)
        self._invited = []

    def _streams(self, members: Members) -> tuple[Member, ...]:
        return tuple(self._stream(rid) for rid in members)

    def _close(self, members: Members) -> None:
        self._joined.pop(members, None)
        group = self._groups.pop(members, None)
        if group is not None:
            group.close()

    def _fail(self, run: Run, members: Members, error: TransportError) -> None:
        with self._cond:
            active = set(run.active())
            for rid in members:
                if rid in active:
                    run.fail(rid, error)


def in_step(joined: tuple[Member, ...], now: tuple[Member, ...]) -> bool:
    """Whether a group whose members joined on the streams ``joined`` can carry a version to
    the streams ``now``: the same ones (a receiver that registered again may have left a
    transfer half done, and a new stream is a new process when it restarted), and none failed a
    version by a transport error since (``ReceiverConn.broadcast_failed``)."""
    return len(joined) == len(now) and all(
        a is b and not b.broadcast_failed for a, b in zip(joined, now, strict=True)
    )


def group_name(run: Run, members: Members) -> str:
    """How errors name a broadcast group of ``run``: the staged buckets' group or a slice
    group, and its receivers."""
    which = next(
        (f"slice group {i}" for i, g in enumerate(run.slices) if g.members == members),
        "the staged buckets' group",
    )
    return f"{which} (receivers {', '.join(members)})"
