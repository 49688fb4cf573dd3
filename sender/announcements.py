"""What a version sends its receivers: which buckets (:func:`sends`), each message (each
receiver's start, its direct bucket, a packed bucket, the end with every bucket's checksum),
and addressing them (:func:`open_version`, :func:`address`): each receiver addressed owes a
reply back, by its deadline. Called with the sender's lock held."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from weightsync.buckets import Bucket
from weightsync.checksum import ALGORITHM, finish_all
from weightsync.errors import TransportError, WeightSyncError
from weightsync.sender.planner import BROADCAST, MAP
from weightsync.sender.records import Outcome, ReceiverConn
from weightsync.sender.slots import Slot
from weightsync.sender.states import ReceiverState
from weightsync.transports.broadcast.slices import SliceGroup
from weightsync.v1 import weightsync_pb2 as pb

if TYPE_CHECKING:
    from weightsync.sender.version import Version
    from weightsync.transports.broadcast import Encoded

Message = Callable[[ReceiverConn], pb.Announcement]
"""Each receiver's message (receivers alike share one)."""


class Send(NamedTuple):
    """One bucket to pack and send: a staged bucket (``group`` None: to the receivers that map
    and those that get the staged buckets by broadcast) or a slice group's."""

    bucket: Bucket
    layout: pb.BucketLayout
    group: SliceGroup | None


def open_version(version: Version, start: Message) -> None:
    """Address ``version`` to every connected receiver, each with its ``start``; one that
    cannot open the staging transport fails at once."""
    for conn in version.shared.registry.receivers():
        if not conn.connected or (version.audience and conn.receiver_id not in version.audience):
            continue
        outcome = version.outcomes[conn.receiver_id] = Outcome()
        if conn.data_path == MAP and conn.transports and version.transport not in conn.transports:
            version.fail(
                conn.receiver_id,
                TransportError(
                    f"receiver {conn.receiver_id} opens {list(conn.transports)}, "
                    f"the sender stages with {version.transport}"
                ),
            )
            continue
        outcome.expect("verdict", version.shared.settings.ack_timeout_s)
        conn.state = ReceiverState.APPLYING
        conn.send(start(conn))


def address(
    version: Version, expect: str, message: Message, to: Callable[[str], bool] | None = None
) -> list[ReceiverConn]:
    """Send every receiver still in ``version`` (those ``to`` accepts) its ``message``; each
    owes ``expect`` back ("applied", or "bucket:<index>": then it may write)."""
    registry = version.shared.registry
    conns = [registry.receiver(rid) for rid in version.active() if to is None or to(rid)]
    for conn in conns:
        outcome = version.outcomes[conn.receiver_id]
        outcome.expect(expect, version.shared.settings.ack_timeout_s)
        outcome.wrote = outcome.wrote or expect.startswith("bucket:")
        conn.send(message(conn))
    return conns


def sends(version: Version) -> list[Send]:
    """Every bucket to send, in order: the staged ones (unless every receiver is in a slice
    group), then each slice group's."""
    everyone_sliced = bool(version.slices) and set(version.outcomes) <= version.sliced
    staged = () if everyone_sliced else version.tensors.staged.buckets
    out = [Send(b, version.tensors.layouts[b.index], None) for b in staged]
    for group in version.slices:
        out += [
            Send(b, layout, group)
            for b, layout in zip(group.plan.buckets, group.layouts, strict=True)
        ]
    return out


def largest_bucket(version: Version) -> int:
    """Bytes every staging slot must hold for ``version`` (at least 256)."""
    tensors = version.tensors
    buckets = [*tensors.staged.buckets, *(b for g in version.slices for b in g.plan.buckets)]
    return max((b.nbytes for b in buckets), default=0) or 256


def starts(version: Version) -> Message:
    """Each receiver's start: the manifest (or its key alone, for a receiver that holds it)
    and how many buckets it gets."""
    counts = {rid: len(g.plan.buckets) for g in version.slices for rid in g.members}
    made: dict[tuple[int, bool], pb.Announcement] = {}

    def start(conn: ReceiverConn) -> pb.Announcement:
        n = counts.get(conn.receiver_id, len(version.tensors.staged.buckets))
        whole = not conn.manifests_sent.alone(version.manifest_key)
        if (n, whole) not in made:
            msg = pb.Announcement()  # filled in place: each nesting in a constructor copies
            start = msg.start
            start.num_buckets, start.manifest_key = n, version.manifest_key
            if whole:
                start.manifest.CopyFrom(_manifest(version))
            else:
                start.manifest.version = version.version
            made[n, whole] = msg
        return made[n, whole]

    return start


def _manifest(version: Version) -> pb.Manifest:
    """The wire manifest at the version, as the first rank sent it (every rank's is the same;
    a rank that sent its begin by key alone sent it for an earlier version)."""
    sent = version.ranks[min(version.ranks)].begin.manifest
    if sent.version == version.version:
        return sent
    msg = pb.Manifest()
    msg.CopyFrom(sent)
    msg.version = version.version
    return msg


def direct_buckets(version: Version) -> Message:
    """Each receiver's own direct bucket (its nearest copies); one that registered after the
    plan reads the lowest ranks' copies."""
    tensors = version.tensors

    def own(conn: ReceiverConn) -> pb.Announcement:
        read = version.direct_reads.get(conn.receiver_id)
        msg = pb.Announcement()
        bucket = msg.bucket
        bucket.version = version.version
        if read is None:
            bucket.layout.CopyFrom(tensors.layouts[tensors.direct.index])
            bucket.sources.extend(tensors.direct_sources)
            return msg
        bucket.layout_key = read.key
        # A receiver that keeps layouts gets the key alone once it has the layout: listing
        # every tensor again costs the sender and each receiver per version.
        if not conn.layouts_sent.alone(read.key):
            bucket.layout.CopyFrom(read.layout)
            bucket.sources.extend(read.sources)
        return msg

    return own


def packed_bucket(
    version: Version,
    layout: pb.BucketLayout,
    slot: Slot,
    group_id: str,
    delta: Encoded | None = None,
    wrote: frozenset[str] = frozenset(),
) -> Message:
    """A packed bucket: receivers that map it get the slot's buffer (and, on CUDA, the event
    their reads wait for), those in ``wrote`` that it is written into their weights (§4.3);
    broadcast receivers get the group its bytes come by (and, when they come as a ``delta``,
    what it is made from: protocol §5.1). Each form is built once, when a receiver needs it:
    each copies the layout, an entry per tensor (hundreds a bucket for MoE)."""
    made: dict[str, pb.Announcement] = {}

    def form(conn: ReceiverConn) -> str:
        if conn.data_path == BROADCAST:
            return "sent"
        return "written" if conn.receiver_id in wrote else "mapped"

    def build(kind: str) -> pb.Announcement:
        # Filled in place: a layout given to a constructor, and the bucket given to the
        # announcement's, are each copied again (1,000 FP8 MoE entries: 0.6-1.3 ms a bucket on
        # a 2-core box, against 0.1-0.16 ms in place).
        msg = pb.Announcement()
        bucket = msg.bucket
        bucket.version = version.version
        bucket.layout.CopyFrom(layout)
        if kind == "written":
            bucket.written = True
        elif kind == "mapped":
            bucket.buffer.CopyFrom(slot.buffer.handle)
            bucket.ready_event = slot.packed_event[1] if slot.packed_event else b""
        else:
            bucket.group_id = group_id
            if delta is not None:
                bucket.delta.CopyFrom(delta.msg)
        return msg

    def message(conn: ReceiverConn) -> pb.Announcement:
        kind = form(conn)
        if kind not in made:
            made[kind] = build(kind)
        return made[kind]

    return message


def end_message(version: Version) -> pb.Announcement:
    """The end, with the checksum of every bucket sent: receivers commit after checking
    theirs. A catch-up's must be those published (WeightSyncError: its source's bytes differ)."""
    sent = [s.bucket for s in sends(version)]
    values = dict(
        zip(
            [b.index for b in sent],
            finish_all([version.sums[b.index] for b in sent], [b.nbytes for b in sent]),
            strict=True,
        )
    )
    # By index; 0 for the staged buckets nobody took (every receiver in a slice group).
    checksums = [values.get(i, 0) for i in range(max(values, default=-1) + 1)]
    differ = [i for i, s in enumerate(version.expect_checksums) if s and s != checksums[i]]
    if differ:
        # The checksum is per bucket: name the tensors one of which differs.
        names = [e.spec.name for b in sent if b.index == differ[0] for e in b.entries]
        held = ", ".join(map(repr, names[:3])) + (f" and {len(names) - 3} more" * (len(names) > 3))
        raise WeightSyncError(
            f"catch-up of version {version.version}: bucket {differ[0]} from its source "
            f"(holding {held}) differs from the version as published (checksum "
            f"{checksums[differ[0]]:#x}, published {version.expect_checksums[differ[0]]:#x}); "
            "not applied"
        )
    version.checksums = checksums
    return pb.Announcement(
        end=pb.VersionEnd(
            version=version.version, checksum_algorithm=ALGORITHM, checksums=checksums
        )
    )
