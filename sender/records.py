"""The sender's records of its peers and versions: receivers, publisher ranks, version runs.

No locks and no threads: the registry, the version history, the outcomes and a version's own
steps (``registry.py``, ``history.py``, ``outcomes.py``, ``version.py``) change them with the
sender's lock held; the servicer only moves their queued messages.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from weightsync import gc_pause
from weightsync.buckets import TensorSpec
from weightsync.manifest import VersionManifest
from weightsync.regions import Region
from weightsync.sender.direct_reads import DirectRead
from weightsync.sender.outbox import Outbox, batched
from weightsync.sender.planner import TensorPlan
from weightsync.sender.slices import SliceGroup
from weightsync.sender.states import OutcomeState, ReceiverState, VersionState
from weightsync.stream_keys import SentKeys
from weightsync.topology_model import Box
from weightsync.v1 import weightsync_pb2 as pb


class RunAborted(Exception):
    """The version was abandoned while a driver waited; the driver just stops."""


@dataclass
class ReceiverConn:
    """One subscribed engine worker and the queue of announcements going to it."""

    receiver_id: str
    engine: str
    rank: int
    device: str
    transports: tuple[str, ...]
    remote: bool = False
    """On another host: it can only receive broadcasts."""
    device_uuid: str = ""
    data_path: str = "map"
    """"map": open the staging buffers (same host); "broadcast": receive them from the sender."""
    outbox: Outbox = field(default_factory=lambda: Outbox(batched))
    connected: bool = True
    applied_version: int = 0
    state: ReceiverState = ReceiverState.IDLE
    dirty: bool = False
    """Some bucket of a failed version was written: its weights match no version."""
    last_error: str = ""
    broadcast_failed: bool = False
    """A version failed here by a transport error since its broadcast group was built: the
    group may be out of step (gloo closes the pair of a receive that timed out), so the next
    version builds it again."""
    layout_keys: bool = False
    """It keeps announced layouts by key (``ReceiverHello.layout_keys``)."""
    manifest_keys: bool = False
    """It keeps announced manifests by key (``ReceiverHello.manifest_keys``)."""
    batches: bool = False
    """It takes several announcements in one message (``ReceiverHello.batches``)."""
    layouts_sent: SentKeys = field(default_factory=SentKeys)
    """The layout keys it holds, sent with their layout on this stream (its registration)."""
    manifests_sent: SentKeys = field(default_factory=SentKeys)
    """The manifest keys it holds, likewise."""
    keeps: Mapping[str, Box] = field(default_factory=dict)
    """The boxes of tensors it keeps only part of, from its last accepted verdict (replaced
    only when they change: the direct-read plans are memoized by this object)."""
    keeps_declared: bool = False
    """A verdict on this stream listed boxes (a later one may say ``keeps_same``)."""
    kept_bytes: int = 0
    """Bytes of its last accepted version it keeps."""
    lane: bool = False
    """Its stream moved to a same-host lane (``weightsync/control/lanes.py``)."""
    held: list[pb.Announcement] | None = None
    """Announcements held to go out as one batch (:meth:`Outcomes.together`)."""
    counted: object = field(default=None, repr=False)
    """The tensor list ``keeps`` were checked against and ``kept_bytes`` counts (manifests
    of one layout share it)."""

    def declare(self, keeps: Mapping[str, Box], specs: Sequence[TensorSpec]) -> None:
        """Take the boxes of an accepted verdict for the version of ``specs``."""
        if (keeps is self.keeps or keeps == self.keeps) and specs is self.counted:
            return
        self.keeps, self.counted = keeps, specs
        self.kept_bytes = sum(
            spec.nbytes
            if spec.name not in keeps
            else keeps[spec.name].numel * spec.torch_dtype.itemsize
            for spec in specs
        )

    def send(self, msg: pb.Announcement | None) -> None:
        if self.held is not None and msg is not None:
            self.held.append(msg)
        elif self.connected or msg is None:
            self.outbox.put(msg)


@dataclass
class PublisherConn:
    """One publisher rank's open ``Publish`` stream, from its hello until the stream ends."""

    publisher_id: str
    rank: int
    world_size: int
    device: str
    device_uuid: str = ""
    connected: bool = True
    lane: bool = False
    """Its stream moved to a same-host lane (``weightsync/control/lanes.py``)."""


@dataclass
class RankConn:
    """One publisher rank's stream for one version."""

    rank: int
    device: str
    begin: pb.BeginVersion = field(default_factory=pb.BeginVersion)
    """What the rank announced, including storages receivers may read directly."""
    device_uuid: str = ""
    """The UUID of the rank's GPU (its ``device`` index is the rank's own numbering)."""
    outbox: queue.Queue = field(default_factory=queue.Queue)
    packed: set[int] = field(default_factory=set)
    """Buckets this rank reported packed (when the publishers pack)."""
    left: bool = False
    """Its stream ended: it packs nothing more."""
    offer: bytes = b""
    """Its part of the version's offer key (``offer.rank_offer``)."""
    wait_applied: bool = False
    """It waits for the version to be applied (``BeginVersion.wait_applied``)."""
    staged_in_done: bool = False
    """It waits for ``done`` and takes it as ``staged`` too (``PublisherHello.staged_in_done``):
    ``staged`` is not sent to it."""


@dataclass
class Outcome:
    """What one receiver did with one version."""

    state: OutcomeState = OutcomeState.PENDING
    error: pb.ErrorDetail | None = None
    applied_at: float = 0.0
    awaiting: set[str] = field(default_factory=set)
    """What the sender waits for from it: "verdict", "bucket:<i>", "applied"."""
    deadline: float | None = None
    wrote: bool = False
    """A bucket was announced to it: failing now may leave its weights a mix."""

    def expect(self, what: str, timeout_s: float) -> None:
        if not self.awaiting:
            self.deadline = time.monotonic() + timeout_s
        self.awaiting.add(what)

    def got(self, what: str, timeout_s: float) -> None:
        self.awaiting.discard(what)
        self.deadline = time.monotonic() + timeout_s if self.awaiting else None

    def overdue(self, now: float) -> bool:
        """It still owes a reply, past its deadline."""
        pending = self.state == OutcomeState.PENDING
        return pending and self.deadline is not None and self.deadline < now


@dataclass
class VersionRun:
    """One published version from begin to every receiver's outcome."""

    manifest: VersionManifest
    tensors: TensorPlan
    """How its tensors travel: staged buckets, the direct bucket, their wire layouts."""
    publisher_id: str
    transport: str
    ranks: dict[int, RankConn]
    regions: Mapping[str, Sequence[Region]] | None = None
    """The publishers' memory mapped here: set when the sender packs every bucket itself."""
    notify_done: bool = False
    """A publisher waits on its stream for every receiver's outcome."""
    direct_reads: Mapping[str, DirectRead] = field(default_factory=dict)
    """Each receiver's own direct bucket, from its nearest copies (as planned)."""
    route_bytes: Mapping[str, int] = field(default_factory=dict)
    """Bytes the receivers take by each route (``planner.ROUTES``), as planned."""
    slices: tuple[SliceGroup, ...] = ()
    """Broadcast receivers that get buckets of the boxes they keep instead of the staged
    buckets (``slices.py``)."""
    manifest_key: bytes = b""
    """An id of the manifest without its version (``VersionStart.manifest_key``)."""
    direct_readers: set[str] = field(default_factory=set)
    """Receivers still copying the direct tensors out of the publishers' memory."""
    sums: dict[int, object] = field(default_factory=dict)
    """Each staged bucket's checksum reduction, queued behind its packing (finished at end)."""
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    started_mono: float = field(default_factory=time.monotonic)
    """When its last rank joined, before it was planned."""
    plan_s: float = 0.0
    staged_s: float = 0.0
    complete_s: float = 0.0
    state: VersionState = VersionState.PACKING
    abandoned: pb.ErrorDetail | None = None
    """Why the version was abandoned, when it was (Status shows it)."""
    gc_hold: gc_pause.Hold | None = field(default=None, repr=False, compare=False)
    """The garbage collector's pause from planning to the version's end (``gc_pause``)."""

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def done(self) -> bool:
        return self.state in (VersionState.COMPLETE, VersionState.FAILED)

    @property
    def left_no_trace(self) -> bool:
        """It failed before any receiver applied it or was sent a byte of it (every receiver
        rejected its manifest, or it was abandoned first): its number is not used up. Every
        receiver's failure is final, so that holds from the last verdict on, even before the
        run itself is marked failed (its publisher may hear first)."""
        outcomes = self.outcomes.values()
        if any(o.wrote or o.state == OutcomeState.APPLIED for o in outcomes):
            return False
        return self.state == VersionState.FAILED or (
            bool(outcomes) and all(o.state == OutcomeState.FAILED for o in outcomes)
        )

    @cached_property
    def manifest_pb(self) -> pb.Manifest:
        """The wire manifest at this version, as the first rank sent it (every rank's is the
        same; a rank that repeated its last begin sent it for an earlier version)."""
        sent = self.ranks[min(self.ranks)].begin.manifest
        if sent.version == self.version:
            return sent
        msg = pb.Manifest()
        msg.CopyFrom(sent)
        msg.version = self.version
        return msg

    @cached_property
    def sliced(self) -> frozenset[str]:
        """The receivers in a slice group (they get its buckets, not the staged ones)."""
        return frozenset(rid for g in self.slices for rid in g.members)

    def active(self) -> list[str]:
        """Receivers still taking part (not failed, not yet applied)."""
        return [rid for rid, o in self.outcomes.items() if o.state == OutcomeState.PENDING]

    def to_pb(self) -> pb.VersionStatus:
        direct = self.tensors.direct
        return pb.VersionStatus(
            version=self.version,
            state=self.state,
            total_bytes=self.manifest.total_bytes,
            direct_bytes=direct.nbytes if direct else 0,
            staged_bytes=self.tensors.staged.total_bytes,
            sender_packed=self.regions is not None,
            route_bytes=self.route_bytes,
            abandoned=self.abandoned,
            num_tensors=len(self.manifest.tensors),
            num_buckets=len(self.tensors.staged.buckets) + (1 if direct else 0),
            started_at_unix_s=self.started_at,
            plan_s=self.plan_s,
            staged_s=self.staged_s,
            complete_s=self.complete_s,
            receivers=[
                pb.ReceiverOutcome(
                    receiver_id=rid, state=o.state, error=o.error, applied_at_unix_s=o.applied_at
                )
                for rid, o in sorted(self.outcomes.items())
            ],
        )

    def tell_staged(self) -> None:
        """``staged`` to each publisher rank of the version that takes it (one that waits for
        ``done`` and said ``staged_in_done`` takes ``done`` as ``staged``)."""
        staged = pb.SenderReply(
            staged=pb.VersionStaged(version=self.version, receivers=len(self.outcomes))
        )
        for rank in self.ranks.values():
            if not rank.staged_in_done:
                rank.outbox.put(staged)

    def tell_done(self) -> None:
        """``done`` to every publisher rank of the version, when they wait for it."""
        if self.notify_done:
            done = pb.SenderReply(done=self.to_pb())
            for rank in self.ranks.values():
                rank.outbox.put(done)

    def log_line(self, abandoned: str = "") -> LogLine:
        """The one log line of a finished version, with its timings as structured fields."""
        applied = sum(o.state == OutcomeState.APPLIED for o in self.outcomes.values())
        direct = self.tensors.direct
        direct_bytes = direct.nbytes if direct else 0
        failures = {
            rid: _one_line(o.error.message if o.error is not None else "")
            for rid, o in self.outcomes.items()
            if o.state == OutcomeState.FAILED
        }
        message = (
            f"version {self.version} {self.state}: {self.manifest.total_bytes / 1e6:.1f} MB "
            f"({direct_bytes / 1e6:.1f} MB direct), {len(self.tensors.staged.buckets)} bucket(s), "
            f"planned {self.plan_s:.3f} s, staged {self.staged_s:.3f} s, "
            f"done {self.complete_s:.3f} s, applied by {applied}/{len(self.outcomes)} receiver(s)"
            + (f"; abandoned: {_one_line(abandoned)}" if abandoned else "")
            + "".join(f"; {rid} failed: {why}" for rid, why in failures.items())
        )
        extra = {
            "event": "version_finished",
            "version": self.version,
            "state": self.state,
            "total_bytes": self.manifest.total_bytes,
            "direct_bytes": direct_bytes,
            "buckets": len(self.tensors.staged.buckets),
            "plan_s": round(self.plan_s, 6),
            "staged_s": round(self.staged_s, 6),
            "done_s": round(self.complete_s, 6),
            "applied": applied,
            "receivers": len(self.outcomes),
            "sender_packed": self.regions is not None,
            "route_bytes": dict(self.route_bytes),
            "publisher_id": self.publisher_id,
            "failed": failures,
        }
        if abandoned:
            extra["abandoned"] = _one_line(abandoned)
        return LogLine(message, extra)


class LogLine(NamedTuple):
    """One INFO line to write off the lock: its text and its structured fields."""

    message: str
    extra: dict


def _one_line(text: str) -> str:
    return " ".join(text.split())
