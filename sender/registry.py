"""The sender's registry: who is connected. Receivers by id (disconnected ones until
``receiver_ttl_s`` passes or more than ``max_disconnected_receivers`` are gone), publisher
ranks with an open stream, and the ``Status`` reply built from them and the version history.

A receiver's applied version and dirty flag come from its hello, every time it registers:
only the receiver knows what its weights are (an engine restarted under its old id holds its
initial weights; one that lost the sender mid-version may hold a mix).

Every mutating method runs with ``cond`` held, the sender's one lock (see ``coordinator.py``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

from weightsync import __version__
from weightsync.config import SenderSettings
from weightsync.errors import ConfigError
from weightsync.metrics import SenderMetrics
from weightsync.sender.history import VersionHistory
from weightsync.sender.planner import BROADCAST, data_paths
from weightsync.sender.records import PublisherConn, ReceiverConn
from weightsync.sender.reports import version_status
from weightsync.sender.states import OutcomeState, ReceiverState
from weightsync.v1 import weightsync_pb2 as pb

if TYPE_CHECKING:
    from weightsync.sender.version import Version

log = logging.getLogger("weightsync.sender")


class Registry:
    """Receivers by id and the publisher ranks connected now; ``history`` supplies the
    versions ``Status`` shows."""

    def __init__(
        self,
        cond: threading.Condition,
        settings: SenderSettings,
        metrics: SenderMetrics,
        history: VersionHistory,
        host_id: str,
    ) -> None:
        self._cond, self._settings, self._metrics = cond, settings, metrics
        self._history = history
        self._host_id = host_id
        """This host's id: a receiver that registers with another is remote."""
        self._receivers: dict[str, ReceiverConn] = {}
        self._gone: dict[str, float] = {}
        """Disconnected receivers by id: when they left (monotonic), oldest first."""
        self._publishers: list[PublisherConn] = []
        """Every publisher rank stream now open (hello received, stream not ended)."""
        self.staging_uuid = ""
        """The GPU the last version was staged on (empty: CPU): a receiver's data path."""

    # ---- receivers ----

    def connected(self, receiver_id: str) -> ReceiverConn | None:
        """The connected receiver of that id, if any (lock held)."""
        conn = self._receivers.get(receiver_id)
        return conn if conn is not None and conn.connected else None

    def add_receiver(self, hello: pb.ReceiverHello) -> ReceiverConn:
        with self._cond:
            self._prune()
            rid = hello.receiver_id or f"{hello.engine or 'receiver'}-{uuid.uuid4().hex[:8]}"
            old = self._receivers.get(rid)
            if old is not None and old.connected:
                raise ConfigError(f"receiver id {rid!r} is already connected; ids must be unique")
            self._gone.pop(rid, None)
            conn = ReceiverConn(
                rid,
                hello.engine,
                hello.rank,
                hello.device,
                tuple(hello.transports),
                remote=bool(hello.host_id) and hello.host_id != self._host_id,
                device_uuid=hello.device_uuid,
            )
            conn.applied_version, conn.dirty = hello.applied_version, hello.dirty
            conn.layouts_sent.peer_keeps = hello.layout_keys
            conn.manifests_sent.peer_keeps = hello.manifest_keys
            conn.batches, conn.exports, conn.deltas = hello.batches, hello.exports, hello.deltas
            conn.state = ReceiverState.DIRTY if hello.dirty else ReceiverState.IDLE
            conn.data_path = data_paths([conn], self._settings.transport, self.staging_uuid)[rid]
            self._receivers[rid] = conn
            self._metrics.set_receivers_connected(self._count_connected())
            host = hello.host_id if conn.remote else f"{self._host_id} (this host)"
            holds = (
                f", applied version {conn.applied_version}" + (" (dirty)" if conn.dirty else "")
                if conn.applied_version or conn.dirty
                else ""
            )
            again = " (registered again)" if old else ""
        log.info(
            "receiver %s connected: engine %s, rank %d, device %s, host %s, data path %s%s%s",
            rid,
            conn.engine or "?",
            conn.rank,
            conn.device or "?",
            host,
            conn.data_path,
            holds,
            again,
            extra={
                "event": "receiver_connected",
                "receiver_id": rid,
                "engine": conn.engine,
                "rank": conn.rank,
                "device": conn.device,
                "host_id": host,
                "data_path": conn.data_path,
                "transports": list(conn.transports),
                "applied_version": conn.applied_version,
                "dirty": conn.dirty,
            },
        )
        return conn

    def disconnect(self, conn: ReceiverConn) -> str | None:
        """Mark ``conn`` gone and end its stream; its state before, or None if it was already
        gone (lock held)."""
        if not conn.connected:
            return None
        conn.connected = False
        was, conn.state = conn.state, ReceiverState.DISCONNECTED
        self._gone[conn.receiver_id] = time.monotonic()
        conn.outbox.put(None)
        self._metrics.set_receivers_connected(self._count_connected())
        return was

    def _prune(self) -> None:
        """Forget disconnected receivers past the TTL, and the oldest past the cap (lock
        held). Versions keep their outcomes: history and WaitApplied do not need the
        receiver; one still owing a version stays until that version fails it."""
        s = self._settings
        expired = time.monotonic() - s.receiver_ttl_s
        excess = len(self._gone) - s.max_disconnected_receivers
        for rid, left_at in list(self._gone.items()):
            if left_at > expired and excess <= 0:
                break  # oldest first: the rest are newer and within the cap
            if self._owes_a_version(rid):
                continue
            del self._gone[rid], self._receivers[rid]
            self._metrics.receiver_forgotten(rid)
            excess -= 1

    def _owes_a_version(self, rid: str) -> bool:
        return any(
            o is not None and o.state == OutcomeState.PENDING
            for o in (run.outcomes.get(rid) for run in self._history.runs())
        )

    def _count_connected(self) -> int:
        return sum(c.connected for c in self._receivers.values())

    def receiver(self, rid: str) -> ReceiverConn:
        return self._receivers[rid]

    def receivers(self) -> list[ReceiverConn]:
        """Every receiver that ever registered, connected or not (lock held)."""
        return list(self._receivers.values())

    def set_data_paths(self, paths: Mapping[str, str]) -> None:
        for rid, path in paths.items():
            self._receivers[rid].data_path = path

    def broadcast_members(self, run: Version) -> list[str]:
        """The receivers still in ``run`` that get its buckets by broadcast."""
        return [rid for rid in run.active() if self._receivers[rid].data_path == BROADCAST]

    @contextmanager
    def together(self) -> Iterator[None]:
        """What is sent to a receiver inside goes out in one message (lock held): a version's
        start, direct bucket and end cost the receiver one stream read, not three. Only to
        receivers that take batches."""
        conns = [c for c in self._receivers.values() if c.connected and c.batches]
        for conn in conns:
            conn.held = []
        try:
            yield
        finally:
            for conn in conns:
                held, conn.held = conn.held, None
                if held and conn.connected:
                    conn.outbox.put(held)

    # ---- publishers ----

    def publisher_connected(self, hello: pb.PublisherHello) -> PublisherConn:
        """A publisher rank's stream said hello (validated): Status counts it until
        :meth:`publisher_left`."""
        world = max(hello.world_size, 1)
        conn = PublisherConn(hello.publisher_id, hello.rank, world, hello.device, hello.device_uuid)
        with self._cond:
            self._publishers.append(conn)
            self._metrics.set_publishers_connected(len(self._publishers))
            last = self._history.last_version
        log.info(
            "publisher %s rank %d/%d connected: device %s; last version %d",
            conn.publisher_id or "''",
            conn.rank,
            world,
            conn.device,
            last,
            extra={
                "event": "publisher_connected",
                "publisher_id": conn.publisher_id,
                "rank": conn.rank,
                "world_size": world,
                "device": conn.device,
                "last_version": last,
            },
        )
        return conn

    def publisher_left(self, conn: PublisherConn, why: str) -> None:
        """Its stream ended (once per stream; later calls do nothing)."""
        with self._cond:
            if not conn.connected:
                return
            conn.connected = False
            self._publishers.remove(conn)
            self._metrics.set_publishers_connected(len(self._publishers))
        log.info(
            "publisher %s rank %d left (%s)",
            conn.publisher_id or "''",
            conn.rank,
            why,
            extra={
                "event": "publisher_left",
                "publisher_id": conn.publisher_id,
                "rank": conn.rank,
                "reason": why,
            },
        )

    # ---- status ----

    def status(self) -> pb.StatusReply:
        with self._cond:
            self._prune()
            s = self._settings
            return pb.StatusReply(
                sender_version=__version__,
                transport=s.transport,
                bucket_size_bytes=s.bucket_size_bytes,
                num_buffers=s.num_buffers,
                publishers=self._publisher_statuses(),
                receivers=[
                    pb.ReceiverStatus(
                        receiver_id=c.receiver_id,
                        engine=c.engine,
                        rank=c.rank,
                        device=c.device,
                        connected=c.connected,
                        applied_version=c.applied_version,
                        state=c.state,
                        last_error=c.last_error,
                        data_path=c.data_path,
                        kept_bytes=c.kept_bytes,
                        lane=c.lane,
                        catch_up=c.catch_up,
                    )
                    for c in sorted(self._receivers.values(), key=lambda c: c.receiver_id)
                ],
                versions=[version_status(run) for run in self._history.runs()],
            )

    def _publisher_statuses(self) -> list[pb.PublisherStatus]:
        """One per publisher id with a rank connected now: its ranks connected, the world
        size and device of its lowest rank."""
        by_id: dict[str, list[PublisherConn]] = {}
        for conn in self._publishers:
            by_id.setdefault(conn.publisher_id, []).append(conn)
        out = []
        for pid in sorted(by_id):
            conns = sorted(by_id[pid], key=lambda c: c.rank)
            out.append(
                pb.PublisherStatus(
                    publisher_id=pid,
                    ranks_connected=len({c.rank for c in conns}),
                    world_size=conns[0].world_size,
                    device=conns[0].device,
                    ranks_on_lanes=len({c.rank for c in conns if c.lane}),
                )
            )
        return out

    def close(self) -> None:
        """End every receiver's stream (the sender shuts down)."""
        with self._cond:
            for conn in self._receivers.values():
                conn.outbox.put(None)
