"""Catch-ups: a receiver that registers behind the current version (a new engine, one restarted
under its old id) gets that version from its nearest copy, without a new publish.

The current version is the newest one some receiver applied. The trainer's memory is no source
(training changed it once ``publish`` returned): the sources are, nearest first, an engine that
applied it and can hand out what it holds (``ReceiverHello.exports``, every tensor kept whole),
then the copy the sender retained in host memory (``--retain-mb``). A catch-up is a
:class:`~weightsync.sender.version.Version` of the same number addressed to the late receiver
alone, its buckets packed by the source as a publisher rank packs them (the source's
``export``/``exported`` stand for ``pack``/``packed``), so it is planned, staged, checksummed and
timed out like any version. Where its buckets are those of the version as published, their
checksums must equal the published ones: a source that hands out other bytes fails the catch-up
(the late receiver then tries the next source, or waits). Versions run one at a time, so no
source applies a newer version while it packs a catch-up; one that moved on refuses (it no
longer holds the version) and the catch-up is planned again from what is current then.

Called with the sender's lock held; the versions this returns are started by the caller off it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from weightsync.buckets import TensorSpec
from weightsync.sender.history import VersionHistory
from weightsync.sender.outcomes import Shared
from weightsync.sender.planner import MAP, plan_tensors
from weightsync.sender.records import RankConn, ReceiverConn
from weightsync.sender.states import OutcomeState, ReceiverState
from weightsync.sender.version import Version
from weightsync.topology_model import Box
from weightsync.transports.base import MappedBuffers
from weightsync.v1 import weightsync_pb2 as pb

RETAINED = "retained"
"""The source name of the sender's own retained copy."""
MAX_TRIES = 3
"""Sources one receiver tries for one version (a source that fails gives way to the next)."""
MAX_RECORDS = 32
"""Catch-ups ``Status`` lists (the oldest go)."""


class Retained:
    """The staged buckets of one version, copied to host memory as they were packed."""

    def __init__(self, nbuckets: int) -> None:
        self.buckets: list[torch.Tensor | None] = [None] * nbuckets

    def keep(self, index: int, data: torch.Tensor) -> None:
        self.buckets[index] = data.to("cpu", copy=True)

    @property
    def complete(self) -> bool:
        return all(b is not None for b in self.buckets)


class _SourceOutbox:
    """A source engine's side of a catch-up: the driver's ``pack`` requests go to it as
    ``export``; what publishers are told (staged, done, abandoned) it does not need."""

    def __init__(self, conn: ReceiverConn) -> None:
        self.conn = conn

    def put(self, item: object) -> None:
        if isinstance(item, pb.SenderReply) and item.WhichOneof("kind") == "pack":
            self.conn.send(pb.Announcement(export=item.pack))


class _RetainedOutbox:
    """The sender's retained copy as a catch-up's packer: each bucket copied into its slot at
    once."""

    def __init__(self, retained: Retained, rank: RankConn, cond) -> None:
        self._retained, self._rank, self._cond = retained, rank, cond
        self._buffers = MappedBuffers()  # the sender's own slots: no mapping, a lookup

    def put(self, item: object) -> None:
        if not (isinstance(item, pb.SenderReply) and item.WhichOneof("kind") == "pack"):
            return
        pack = item.pack
        data = self._retained.buckets[pack.layout.index]
        slot = self._buffers.get(pack.buffer)
        slot[: data.numel()].copy_(data)
        if slot.is_cuda:
            torch.cuda.current_stream(slot.device).synchronize()
        with self._cond:
            self._rank.packed.add(pack.layout.index)
            self._cond.notify_all()


@dataclass
class CatchUp:
    """One catch-up as Status shows it."""

    receiver_id: str
    source: str
    run: Version
    bytes: int
    route: str
    error: pb.ErrorDetail | None = None

    def status(self) -> pb.CatchUpStatus:
        run = self.run
        outcome = run.outcomes.get(self.receiver_id)
        failed = outcome is not None and outcome.state == OutcomeState.FAILED
        error = self.error or (outcome.error if failed else None) or run.abandoned
        return pb.CatchUpStatus(
            receiver_id=self.receiver_id,
            version=run.version,
            source=self.source,
            state=run.state,
            bytes=self.bytes,
            started_at_unix_s=run.started_at,
            complete_s=run.complete_s,
            error=error,
            route=self.route,
        )


@dataclass
class _Current:
    """The newest version some receiver applied: what a catch-up re-sends of it."""

    run: Version
    device: torch.device
    retained: Retained | None = None


@dataclass
class CatchUps:
    """Who is behind, from whom each catches up, and the catch-ups in flight."""

    shared: Shared
    history: VersionHistory
    current: _Current | None = None
    active: dict[str, CatchUp] = field(default_factory=dict)
    """By the late receiver's id, while its catch-up runs."""
    records: list[CatchUp] = field(default_factory=list)
    tried: dict[tuple[str, int], set[str]] = field(default_factory=dict)
    """The sources each (receiver, version) was caught up from already: a failed one is not
    tried again for it."""
    devices: dict[int, torch.device] = field(default_factory=dict)
    """Each version's staging device, by number, while it may become current."""

    # ---- what the versions tell ----

    def planned(self, run: Version, device: torch.device) -> None:
        """A published version is planned: retain it when configured and its staged buckets
        fit (it may become current)."""
        self.devices[run.version] = device
        limit = self.shared.settings.retain_bytes
        staged = run.tensors.staged
        if limit and run.tensors.direct is None and 0 < staged.total_bytes <= limit:
            run.retained = Retained(len(staged.buckets))

    def finished(self, run: Version) -> list[tuple[Version, torch.device]]:
        """A version or catch-up is over: it may be current now, a failed catch-up tries its
        next source, and receivers that waited may catch up. Returns what to start."""
        catch_up = next((c for c in self.active.values() if c.run is run), None)
        if catch_up is not None:
            del self.active[catch_up.receiver_id]
        kept, run.retained = run.retained, None  # only the current version's copy is held
        if catch_up is None and any(o.state == OutcomeState.APPLIED for o in run.outcomes.values()):
            device = self.devices.pop(run.version, None)
            newer = self.current is None or run.version > self.current.run.version
            if device is not None and newer:
                self.current = _Current(run, device, kept if kept and kept.complete else None)
                self.tried = {k: v for k, v in self.tried.items() if k[1] >= run.version}
            for old in [v for v in self.devices if v < run.version]:
                del self.devices[old]
        return self.behind()

    def exported(self, conn: ReceiverConn, msg: pb.BucketExported) -> None:
        """A source answered ``export``: its part of the bucket is written, or the catch-up
        fails."""
        for catch_up in self.active.values():
            rank = _rank_of(catch_up.run, conn)
            if rank is None or catch_up.run.version != msg.version or catch_up.run.done:
                continue
            if msg.ok:
                rank.packed.add(msg.index)
                self.shared.cond.notify_all()
            else:
                catch_up.error = msg.error
                catch_up.run.abort(msg.error)

    def source_left(self, conn: ReceiverConn) -> None:
        """A source's stream ended: its catch-ups fail (each tries its next source)."""
        for catch_up in list(self.active.values()):
            if _rank_of(catch_up.run, conn) is not None and not catch_up.run.done:
                detail = pb.ErrorDetail(
                    code="TransportError",
                    message=f"catch-up source receiver {conn.receiver_id} left",
                )
                catch_up.error = detail
                catch_up.run.abort(detail)

    # ---- deciding ----

    def behind(self) -> list[tuple[Version, torch.device]]:
        """A catch-up for every receiver behind the current version that nothing else brings
        up to date; the others hear why they wait (``ReceiverStatus.catch_up``)."""
        out = []
        for conn in self.shared.registry.receivers():
            run = self.joined(conn)
            if run is not None:
                out.append(run)
        return out

    def joined(self, conn: ReceiverConn) -> tuple[Version, torch.device] | None:
        """``conn`` (just registered, or still behind): its catch-up to start, if it gets one."""
        current = self.current
        if current is None or not conn.connected or conn.receiver_id in self.active:
            return None
        version = current.run.version
        if conn.applied_version >= version and not conn.dirty:
            return None
        if conn.registered_mono < current.run.started_mono:
            return None  # it was addressed the version (and failed it): no catch-up heals that
        if self._in_a_version(conn):
            return None  # a version on its way brings it up to date
        if conn.data_path == MAP and current.run.transport not in (conn.transports or ()):
            conn.catch_up = (
                f"waits for the next version: version {version} was staged with "
                f"{current.run.transport}, which it does not open"
            )
            return None
        tried = self.tried.setdefault((conn.receiver_id, version), set())
        if len(tried) >= MAX_TRIES:
            conn.catch_up = f"waits for the next version: catch-ups to version {version} failed"
            return None
        sources = self._nearest(conn, current, tried)
        if sources is None:
            conn.catch_up = (
                f"waits for the next version: no receivers that applied version {version} can "
                "hand it out together (none said `exports`, or what they keep does not cover "
                "every tensor) and the sender retains no copy of it (weightsync-sender "
                "--retain-mb)"
            )
            return None
        run = self._run(conn, current, sources)
        names = [_name(source) for source in sources]
        tried.update(names)
        name = (
            names[0]
            if len(names) == 1
            else f"receivers {', '.join(sorted(s.receiver_id for s in sources))}"
        )
        nbytes = run.tensors.staged.total_bytes
        ways = sorted({route(conn, source) for source in sources})
        catch_up = CatchUp(conn.receiver_id, name, run, nbytes, "+".join(ways))
        self.active[conn.receiver_id] = catch_up
        self.records = [*self.records, catch_up][-MAX_RECORDS:]
        conn.catch_up = f"version {version} from {name}"
        return run, current.device

    def _in_a_version(self, conn: ReceiverConn) -> bool:
        rid = conn.receiver_id
        return any(rid in run.active() for run in self.history.runs())

    def runs(self) -> list[Version]:
        return [c.run for c in self.active.values()]

    def run_for(self, rid: str, version: int) -> Version | None:
        """The catch-up of ``rid`` that a reply of ``version`` belongs to, if any."""
        catch_up = self.active.get(rid)
        return catch_up.run if catch_up is not None and catch_up.run.version == version else None

    def _nearest(
        self, conn: ReceiverConn, current: _Current, tried: set[str]
    ) -> list[ReceiverConn] | list[Retained] | None:
        """The nearest receivers that hold the current version and together cover it (one
        that keeps it whole, or engine ranks whose boxes tile each tensor), else the retained
        copy."""
        run = current.run
        holders = [
            c
            for c in self.shared.registry.receivers()
            if c is not conn and _name(c) not in tried and holds(c, run.version, run.transport)
        ]
        chosen = cover(run.manifest.tensors, sorted(holders, key=lambda h: distance(conn, h)))
        if chosen:
            return chosen
        return [current.retained] if current.retained and RETAINED not in tried else None

    def _run(self, conn: ReceiverConn, current: _Current, sources: list) -> Version:
        """The catch-up: ``current``'s manifest and buckets, addressed to ``conn`` alone, each
        bucket packed by every one of ``sources`` (its part of it)."""
        published = current.run
        tensors, expect = published.tensors, published.checksums
        if tensors.direct is not None:
            # Its direct tensors were read in place from the trainer: here they are staged too,
            # in buckets of their own layout (no published checksums to compare).
            manifest = published.manifest
            tensors = plan_tensors(manifest, {}, False, self.shared.settings.bucket_size_bytes)
            expect = ()
        first = published.ranks[min(published.ranks)]
        ranks = {}
        for i, source in enumerate(sources):
            rank = ranks[i] = RankConn(i, str(current.device), first.begin)
            if isinstance(source, Retained):
                rank.outbox = _RetainedOutbox(source, rank, self.shared.cond)
            else:
                rank.outbox = _SourceOutbox(source)
        return Version(
            published.manifest,
            replace(tensors, sender_packs=False),
            published.publisher_id,
            published.transport,
            ranks,
            shared=self.shared,
            manifest_key=published.manifest_key,
            audience=frozenset({conn.receiver_id}),
            expect_checksums=expect,
        )

    def statuses(self) -> list[pb.CatchUpStatus]:
        return [c.status() for c in self.records]


def holds(conn: ReceiverConn, version: int, transport: str) -> bool:
    """``conn`` can be a catch-up source of ``version``: it applied it and is not writing
    another, can hand out what it keeps, and writes into this sender's staging buffers."""
    return (
        conn.connected
        and conn.exports
        and conn.applied_version == version
        and not conn.dirty
        and conn.state == ReceiverState.IDLE
        and conn.data_path == MAP
        and transport in conn.transports
    )


def cover(specs: Sequence[TensorSpec], holders: Sequence[ReceiverConn]) -> list[ReceiverConn]:
    """The first of ``holders`` (nearest first) that keep every tensor whole, else the fewest
    from the front whose kept boxes tile every tensor (engine TP ranks: disjoint boxes whose
    sizes add up to it); empty when they do not cover it."""
    whole = next((h for h in holders if not h.keeps), None)
    if whole is not None:
        return [whole]
    have: dict[str, list[Box]] = {spec.name: [] for spec in specs}
    left = {spec.name: spec.numel for spec in specs}
    chosen = []
    for holder in holders:
        adds = False
        for name in [n for n, k in left.items() if k]:
            box = holder.keeps.get(name)
            if box is None:
                left[name], adds = 0, True
            elif not any(box.overlaps(b) for b in have[name]):
                have[name].append(box)
                left[name] -= box.numel
                adds = True
        if adds:
            chosen.append(holder)
        if not any(left.values()):
            return chosen
    return []


def route(conn: ReceiverConn, source: ReceiverConn | Retained) -> str:
    """How a catch-up's bytes go from ``source`` to ``conn`` (``CatchUpStatus.route``)."""
    if isinstance(source, Retained):
        return RETAINED
    if not (conn.device_uuid and source.device_uuid):
        return "host"
    return "local" if conn.device_uuid == source.device_uuid else "peer"


def distance(conn: ReceiverConn, holder: ReceiverConn) -> tuple[int, str]:
    """How near ``holder`` is to ``conn``: on its GPU, then on a GPU at all (peer copies),
    then any; ties by id, so the choice is stable."""
    if conn.device_uuid and holder.device_uuid == conn.device_uuid:
        return 0, holder.receiver_id
    return (1 if holder.device_uuid else 2), holder.receiver_id


def _name(source: ReceiverConn | Retained) -> str:
    return RETAINED if isinstance(source, Retained) else f"receiver {source.receiver_id}"


def _rank_of(run: Version, conn: ReceiverConn) -> RankConn | None:
    """The packer rank of catch-up ``run`` that source ``conn`` is, if any."""
    for rank in run.ranks.values():
        if isinstance(rank.outbox, _SourceOutbox) and rank.outbox.conn is conn:
            return rank
    return None
