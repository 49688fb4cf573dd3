"""The sender's records of its peers: receivers, publisher ranks, and what one receiver did
with one version (the version itself: ``version.py``).

No locks and no threads: the registry and the versions (``registry.py``, ``version.py``) change
them with the sender's lock held; the servicer only moves their queued messages.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from weightsync.buckets import TensorSpec
from weightsync.errors import ProtocolError, TransportError
from weightsync.sender.outbox import Outbox, batched
from weightsync.sender.states import OutcomeState, ReceiverState
from weightsync.stream_keys import KeptByKey, SentKeys
from weightsync.topology_model import Box
from weightsync.v1 import weightsync_pb2 as pb

if TYPE_CHECKING:
    from weightsync.sender.writes import Offered


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
    batches: bool = False
    """It takes several announcements in one message (``ReceiverHello.batches``)."""
    layouts_sent: SentKeys = field(default_factory=SentKeys)
    """The layout keys it holds, sent with their layout on this stream (its registration);
    ``peer_keeps``: its hello said ``layout_keys``."""
    manifests_sent: SentKeys = field(default_factory=SentKeys)
    """The manifest keys it holds, likewise (``manifest_keys``)."""
    keeps: Mapping[str, Box] = field(default_factory=dict)
    """The boxes of tensors it keeps only part of, from its last accepted verdict (replaced
    only when they change: the direct-read plans are memoized by this object)."""
    keeps_by_key: KeptByKey[tuple[Mapping[str, Box], Sequence[TensorSpec]]] = field(
        default_factory=lambda: KeptByKey("keeps_key")
    )
    """The boxes its verdicts on this stream listed, by ``ManifestVerdict.keeps_key``, with
    the tensor list they were checked against."""
    kept_bytes: int = 0
    """Bytes of its last accepted version it keeps."""
    write_offers: KeptByKey[Offered | None] = field(default_factory=lambda: KeptByKey("writes_key"))
    """Its offers to have the sender write its weights, mapped here (None: one that did not
    map), by ``WriteOffer.key`` (``writes.py``)."""
    lane: bool = False
    """Its stream moved to a same-host lane (``weightsync/control/lanes.py``)."""
    exports: bool = False
    """It can be a catch-up source (``ReceiverHello.exports``; ``catch_ups.py``)."""
    deltas: bool = False
    """It decodes broadcast buckets sent as deltas (``ReceiverHello.deltas``)."""
    holds: int = 0
    """The version whose broadcast buckets it keeps as delta bases (``holds_base`` of its last
    applied version on this stream; 0: none)."""
    catch_up: str = ""
    """Its catch-up, or why it waits for the next version (``ReceiverStatus.catch_up``)."""
    registered_mono: float = field(default_factory=time.monotonic)
    held: list[pb.Announcement] | None = None
    """Announcements held to go out as one batch (:meth:`Registry.together`)."""
    presented: deque[pb.Announcement] = field(default_factory=deque)
    """A version's messages sent ahead of its plan (``armed.py``), in order: its own start
    then sends each again, and each goes no second time. Its replies wait until they are
    all sent (the version then expects them)."""
    counted: object = field(default=None, repr=False)
    """The tensor list ``keeps`` were checked against and ``kept_bytes`` counts (manifests
    of one layout share it)."""
    keeps_mono: float = 0.0
    """When ``keeps`` was last replaced (``time.monotonic``)."""

    def declare(self, keeps: Mapping[str, Box], specs: Sequence[TensorSpec]) -> None:
        """Take the boxes of an accepted verdict for the version of ``specs``."""
        if (keeps is self.keeps or keeps == self.keeps) and specs is self.counted:
            return
        self.keeps, self.counted, self.keeps_mono = keeps, specs, time.monotonic()
        self.kept_bytes = sum(
            spec.nbytes
            if spec.name not in keeps
            else keeps[spec.name].numel * spec.torch_dtype.itemsize
            for spec in specs
        )

    # What its weights are now (``state``), as a version moves it:

    def rejected(self, error: str) -> None:
        """It rejected a version before writing: it still holds its previous weights."""
        self.state = ReceiverState.DIRTY if self.dirty else ReceiverState.IDLE
        self.last_error = error

    def applied(self, version: int, holds_base: bool = False) -> None:
        self.applied_version, self.last_error, self.catch_up = version, "", ""
        self.holds = version if holds_base else 0
        self.state, self.dirty = ReceiverState.IDLE, False

    def failed_writing(self, error: str) -> None:
        """It failed a version after writing: its weights match no version until the next."""
        self.state, self.dirty, self.last_error = ReceiverState.DIRTY, True, error
        self.holds = 0

    def left_version(self, detail: pb.ErrorDetail, wrote: bool) -> None:
        """It is out of a version (``wrote``: a bucket of it was announced to it); what it
        kept of the previous one may have changed since (its buckets go in full next)."""
        self.holds = 0
        if self.state == ReceiverState.APPLYING:
            # Told to abort after a bucket (its publisher died, a timeout): it may have
            # written some; its next hello says for sure.
            self.dirty = self.dirty or wrote
            self.state = ReceiverState.DIRTY if self.dirty else ReceiverState.FAILED
        self.last_error = self.last_error or detail.message
        self.broadcast_failed = self.broadcast_failed or detail.code == TransportError.__name__

    def send(self, msg: pb.Announcement | None) -> None:
        if self.presented and msg is not None and self._was_presented(msg):
            return
        if self.held is not None and msg is not None:
            self.held.append(msg)
        elif self.connected or msg is None:
            self.outbox.put(msg)

    def _was_presented(self, msg: pb.Announcement) -> bool:
        """Whether ``msg`` is the next message sent ahead of its version's plan; anything else
        goes as usual (an abort of that version drops the rest).

        Raises:
            ProtocolError: the plan made another message than the one sent ahead (the
                version is abandoned; ``armed.py`` presents only what planning repeats).
        """
        kind, ahead = msg.WhichOneof("kind"), announced_version(self.presented[0])
        if kind not in _OF_A_VERSION or announced_version(msg) != ahead:
            return False
        if kind == "abort":
            self.presented.clear()
            return False
        sent = self.presented.popleft()
        if msg == sent:
            return True
        self.presented.clear()
        raise ProtocolError(
            f"receiver {self.receiver_id}: the {kind} of version {announced_version(msg)} as "
            f"planned differs from the {sent.WhichOneof('kind')} sent ahead of its plan (armed "
            "start); the version is abandoned and the next one is planned first"
        )


_OF_A_VERSION = ("start", "bucket", "end", "abort")
"""The kinds of message that belong to one version (the first three may go ahead of its plan)."""


def announced_version(msg: pb.Announcement) -> int:
    """The version a start, bucket, end or abort is of."""
    kind = msg.WhichOneof("kind")
    return msg.start.manifest.version if kind == "start" else getattr(msg, kind).version


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
    """A bucket was announced to it: failing now may leave its weights a mix (cleared when
    it says it wrote nothing: it rejected the manifest, or failed before its first load)."""

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
