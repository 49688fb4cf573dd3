"""The armed start (issue 32): a direct version announced to its receivers before it is planned.

A version whose tensors every receiver reads in place (direct) sends each receiver its start,
its direct bucket and its end, a few bytes each once the receiver holds the manifest and the
layout by key. When the next version comes from the same publisher with the same manifest and
offer, while the same receivers wait, its plan makes the same messages but for the version
number: the sender sends them at once, made from the last version's, and plans the version
while the receivers' copies run. The sender's planning and addressing leave the path between
``publish`` and the copies: 0.2-0.5 ms a version on the lent H200 hosts (docs/benchmarks.md).

The version's start then sends each message again as planned: one equal to the one sent
ahead goes no second time (``ReceiverConn.send``); one that differs abandons the version
(receivers are told; they copied only the version's own bytes out of the publisher's
memory). A presented receiver's replies wait until the version expects them
(``Outcomes.on_receiver_message``); the coordinator queues the version to its driver before
it lets the lock go, so no other version (a catch-up) comes between. All this runs with the
sender's lock held.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from weightsync import trace
from weightsync.sender.announcements import direct_buckets, end_message, starts
from weightsync.sender.records import RankConn, ReceiverConn
from weightsync.sender.states import ReceiverState, VersionState
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import error_to_pb

if TYPE_CHECKING:
    from weightsync.sender.catch_ups import CatchUps
    from weightsync.sender.history import VersionHistory
    from weightsync.sender.outcomes import Shared
    from weightsync.sender.registry import Registry
    from weightsync.sender.version import Version


class ArmedStarts:
    """Direct versions sent ahead of their plan, when planning repeats the last version's."""

    def __init__(self, shared: Shared, history: VersionHistory, catch_ups: CatchUps) -> None:
        self._shared, self._history, self._catch_ups = shared, history, catch_ups

    @contextmanager
    def ahead(
        self, ranks: dict[int, RankConn], publisher_id: str, manifest_key: bytes, version: int
    ) -> Iterator[list[ReceiverConn]]:
        """Send ``version``'s start, direct bucket and end to every receiver, made from the
        last version's, when planning it repeats them (:func:`repeats`), then plan it inside
        (lock held); yields the receivers they went to (none: it is announced once planned,
        as any other). A plan that fails tells them to abort it."""
        last, registry = self._history.newest(), self._shared.registry
        # Once the newest version completed the older ones are over too: one driver runs
        # versions in turn and every receiver applies them in order. Catch-ups run apart.
        busy = any(not run.done for run in self._catch_ups.runs())
        on = self._shared.settings.armed_starts and not busy
        conns = repeats(last, ranks, publisher_id, manifest_key, registry) if on else []
        if conns:
            start, bucket, end = starts(last), direct_buckets(last), end_message(last)
            with registry.together():  # one message to each receiver
                for conn in conns:
                    sent = [_at(m, version) for m in (start(conn), bucket(conn), end)]
                    for msg in sent:
                        conn.send(msg)
                    conn.presented = deque(sent)
            trace.mark("sender.presented", version=version)
            self._shared.metrics.version_presented()
        try:
            yield conns
        except BaseException as e:
            abort = pb.Announcement(abort=pb.VersionAbort(version=version, reason=error_to_pb(e)))
            for conn in conns:
                if conn.presented:
                    conn.send(abort)
            raise


def repeats(
    last: Version | None,
    ranks: dict[int, RankConn],
    publisher_id: str,
    manifest_key: bytes,
    registry: Registry,
) -> list[ReceiverConn]:
    """The receivers to which planning the next version gives ``last``'s messages again; none
    unless it would for each: ``last`` completed, everything it sent was direct, its publisher,
    manifest and offer are the next one's, and the receivers connected are those that applied
    it, on the same streams, with the boxes they kept when it was planned (the plan is a
    function of these). The caller checks that nothing else is under way."""
    if last is None or last.state != VersionState.COMPLETE or last.audience is not None:
        return []
    if last.tensors.direct is None or last.tensors.staged.buckets or last.slices:
        return []
    if (last.publisher_id, last.manifest_key) != (publisher_id, manifest_key):
        return []
    if _offer(last.ranks) != _offer(ranks):
        return []
    conns = [c for c in registry.receivers() if c.connected]
    if not conns or {c.receiver_id for c in conns} != set(last.outcomes):
        return []
    for conn in conns:
        if not (
            conn.batches
            and conn.state == ReceiverState.IDLE
            and conn.applied_version == last.version
            and conn.registered_mono < last.started_mono
            and conn.keeps_mono < last.started_mono
            and conn.receiver_id in last.direct_reads
            and not conn.presented
        ):
            return []
    return conns


def _offer(ranks: dict[int, RankConn]) -> tuple:
    """What the plan takes of the ranks' begins beside the manifest: each one's offer and
    whether it allows direct reads."""
    return tuple((ranks[r].offer, ranks[r].begin.allow_direct) for r in sorted(ranks))


def _at(msg: pb.Announcement, version: int) -> pb.Announcement:
    """``msg`` (a start, bucket or end) for ``version``."""
    out = pb.Announcement()
    out.CopyFrom(msg)
    kind = out.WhichOneof("kind")
    if kind == "start":
        out.start.manifest.version = version
    else:
        getattr(out, kind).version = version
    return out
