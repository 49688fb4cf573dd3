"""The sender's version state machine: who gets what, which buffer is free, who failed.

One lock guards all state; one condition wakes every waiter (drivers waiting for a free slot
or for packed buckets, ``WaitApplied`` callers). A monitor thread fails receivers that owe a
reply past ``ack_timeout_s``, so a dead or stalled receiver never blocks the others.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict, deque

import torch
from weightsync.sender.broadcaster import Broadcaster
from weightsync.sender.driver import VersionDriver
from weightsync.sender.offer import Offer
from weightsync.sender.runs import (
    APPLIED,
    FAILED,
    PENDING,
    VERSION_OVER,
    Outcome,
    RankConn,
    ReadEvent,
    ReceiverConn,
    RunAborted,
    Slot,
    VersionRun,
)

from weightsync import __version__, trace
from weightsync.config import SenderSettings
from weightsync.errors import (
    ConfigError,
    ProtocolError,
    SyncTimeoutError,
    TransportError,
    VersionError,
    WeightSyncError,
)
from weightsync.manifest import VersionManifest
from weightsync.metrics import SenderMetrics
from weightsync.transports import resolve_transport
from weightsync.transports.broadcast import host_id
from weightsync.transports.cuda_ipc import EventCache, device_uuid, local_index_of
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import (
    ManifestCache,
    ParseCache,
    error_to_pb,
)

log = logging.getLogger("weightsync.sender")


class Coordinator(VersionDriver):
    def __init__(self, settings: SenderSettings, metrics: SenderMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._cond = threading.Condition()
        self._receivers: dict[str, ReceiverConn] = {}
        self._publishers: dict[str, pb.PublisherStatus] = {}
        self._joining: dict[tuple[str, int], tuple[VersionManifest, int, dict[int, RankConn]]] = {}
        self._runs: OrderedDict[int, VersionRun] = OrderedDict()
        self._slots: list[Slot] = []
        self._last_version = 0
        self._drive_lock = threading.Lock()
        self._broadcaster = Broadcaster(settings.broadcast_host, settings.ack_timeout_s)
        self._host_id = host_id()
        self._manifests = ManifestCache()
        self._offers = ParseCache(lambda args: Offer.of(*args), max_entries=4)
        self._events = EventCache()
        self._copies: tuple[object, dict] = (None, {})
        """Pack copies (destination, source views) by (staging buffer, bucket), for one
        mapping of offered regions (see ``VersionDriver._pack``)."""
        self._stop = threading.Event()
        self._finished: deque[tuple] = deque()
        """Log lines of finished versions; the monitor writes them, off the path of replies."""
        self._monitor = threading.Thread(target=self._watch_deadlines, daemon=True)
        self._monitor.start()

    # ---- receivers ----

    def add_receiver(self, hello: pb.ReceiverHello) -> ReceiverConn:
        with self._cond:
            rid = hello.receiver_id or f"{hello.engine or 'receiver'}-{uuid.uuid4().hex[:8]}"
            old = self._receivers.get(rid)
            if old is not None and old.connected:
                raise ConfigError(f"receiver id {rid!r} is already connected; ids must be unique")
            conn = ReceiverConn(
                rid,
                hello.engine,
                hello.rank,
                hello.device,
                tuple(hello.transports),
                remote=bool(hello.host_id) and hello.host_id != self._host_id,
                device_uuid=hello.device_uuid,
            )
            if old is not None:
                conn.applied_version, conn.dirty = old.applied_version, old.dirty
            self._receivers[rid] = conn
            return conn

    def receiver_gone(self, conn: ReceiverConn, why: str) -> None:
        with self._cond:
            if not conn.connected:
                return
            conn.connected = False
            conn.state = "disconnected"
            for run in self._runs.values():
                if run.outcomes.get(conn.receiver_id, Outcome(APPLIED)).state == PENDING:
                    self._fail(run, conn.receiver_id, ProtocolError(f"receiver {why}"))
            conn.outbox.put(None)

    def on_receiver_message(self, conn: ReceiverConn, msg: pb.ReceiverMessage) -> None:
        kind = msg.WhichOneof("kind")
        body = getattr(msg, kind)
        trace.mark(f"sender.{kind}", receiver=conn.receiver_id, index=getattr(body, "index", -1))
        with self._cond:
            run = self._runs.get(body.version)
            outcome = run.outcomes.get(conn.receiver_id) if run else None
            if run is None or outcome is None or outcome.state != PENDING:
                return  # late reply for a version it already left
            timeout = self.settings.ack_timeout_s
            if kind == "verdict":
                outcome.got("verdict", timeout)
                if not body.accepted:
                    # Rejected before any write: it still holds its previous weights.
                    conn.state = "dirty" if conn.dirty else "idle"
                    conn.last_error = body.error.message
                    self._fail(run, conn.receiver_id, body.error, notify=False)
            elif kind == "ack":
                outcome.got(f"bucket:{body.index}", timeout)
                try:
                    self._release_reader(conn.receiver_id, run.version, body.index, body.read_event)
                except TransportError as e:
                    self._fail_dirty(run, conn, error_to_pb(e))
                if run.direct is not None and body.index == run.direct.index:
                    run.direct_readers.discard(conn.receiver_id)
                if not body.ok:
                    self._fail_dirty(run, conn, body.error)
            elif kind == "applied":
                outcome.got("applied", timeout)
                if body.ok:
                    outcome.state, outcome.applied_at = APPLIED, time.time()
                    conn.applied_version, conn.state, conn.last_error = run.version, "idle", ""
                    conn.dirty = False
                    self.metrics.receiver_applied(conn.receiver_id, run.version)
                else:
                    self._fail_dirty(run, conn, body.error)
            self._maybe_complete(run)
            self._cond.notify_all()

    def _fail_dirty(self, run: VersionRun, conn: ReceiverConn, error: pb.ErrorDetail) -> None:
        """The receiver failed after writing: its weights match no version until the next."""
        conn.state, conn.dirty, conn.last_error = "dirty", True, error.message
        self._fail(run, conn.receiver_id, error, notify=False)

    # ---- publishers ----

    def join(
        self, hello: pb.PublisherHello, begin: pb.BeginVersion, outbox: queue.Queue
    ) -> tuple[VersionRun | None, RankConn]:
        """Add one publisher rank to a version (its replies go to ``outbox``, the rank's
        stream); the last rank to join starts the run."""
        manifest, manifest_key = self._manifests(begin.manifest)
        trace.mark("sender.begin", version=manifest.version, rank=hello.rank)
        world = max(hello.world_size, 1)
        if hello.rank >= world:
            raise ConfigError(f"publisher rank {hello.rank} is not below world_size {world}")
        with self._cond:
            if manifest.version <= self._last_version:
                raise VersionError(
                    f"version {manifest.version} is not greater than the last published version "
                    f"{self._last_version}; publish {self._last_version + 1} or later"
                )
            key = (hello.publisher_id, manifest.version)
            first, first_world, ranks = self._joining.setdefault(key, (manifest, world, {}))
            if world != first_world:
                raise ConfigError(
                    f"rank {hello.rank} says world_size {world}, others {first_world}"
                )
            if manifest != first:
                raise ConfigError(
                    f"rank {hello.rank} announced a manifest for version {manifest.version} that "
                    "differs from the other ranks'; every rank must plan the same HF tensors"
                )
            if hello.rank in ranks:
                raise ConfigError(
                    f"publisher rank {hello.rank} joined version {manifest.version} twice"
                )
            conn = RankConn(
                hello.rank, hello.device, begin, begin_uuid=hello.device_uuid, outbox=outbox
            )
            ranks[hello.rank] = conn
            self._publishers[hello.publisher_id] = pb.PublisherStatus(
                publisher_id=hello.publisher_id,
                ranks_connected=len(ranks),
                world_size=world,
                device=hello.device,
            )
            if len(ranks) < world:
                return None, conn
            del self._joining[key]
            device = _staging_device(ranks[min(ranks)])
            transport = resolve_transport(self.settings.transport, device)
            self._assign_data_paths(device)
            run = self._plan_run(manifest, manifest_key, hello.publisher_id, transport, ranks)
            self._last_version = manifest.version
            self._runs[manifest.version] = run
            while len(self._runs) > self.settings.history:
                self._runs.popitem(last=False)
        threading.Thread(target=self._drive, args=(run, device), daemon=True).start()
        return run, conn

    def _assign_data_paths(self, staging: torch.device) -> None:
        """Map the staging buffers where possible, else receive broadcasts.

        Receivers on another host always get broadcasts; with ``transport=nccl`` so does every
        receiver except one on the staging GPU itself, which NCCL cannot put in a group with
        the sender (two ranks on one GPU).
        """
        staging_uuid = device_uuid(staging)
        for conn in self._receivers.values():
            on_staging_gpu = bool(staging_uuid) and conn.device_uuid == staging_uuid
            broadcast = conn.remote or (self.settings.transport == "nccl" and not on_staging_gpu)
            conn.data_path = "broadcast" if broadcast else "map"

    def _plan_run(
        self,
        manifest: VersionManifest,
        manifest_key: bytes,
        publisher_id: str,
        transport: str,
        ranks: dict[int, RankConn],
    ) -> VersionRun:
        """Decide per tensor how it travels, and who packs the staged buckets.

        A tensor offered as one whole contiguous region goes direct when a publisher allows
        it and every receiver maps CUDA IPC memory of this host. The sender packs the staged
        buckets itself when the offered regions cover every staged tensor and it can map them
        (CUDA IPC, or shm buffers a publisher allocated); otherwise the publishers pack (one
        round trip per bucket). Both are worked out once per (manifest, offer) and reused
        every version.
        """
        offer = self._offers((manifest, ranks), key=(manifest_key, _offer_key(ranks)))
        receivers = [c for c in self._receivers.values() if c.connected]
        direct_ok = (
            any(r.begin.allow_direct for r in ranks.values())
            and transport == "cuda_ipc"
            and all(c.data_path == "map" for c in receivers)
        )
        planned = offer.planned(direct_ok, self.settings.bucket_size_bytes)
        run = VersionRun(
            manifest, planned.plan, publisher_id, transport, ranks, planned.direct, offer.sources
        )
        run.layouts = planned.layouts
        run.regions = planned.regions
        run.notify_done = any(r.begin.wait_applied for r in ranks.values())
        return run

    def on_packed(self, run: VersionRun, rank: RankConn, index: int) -> None:
        trace.mark("sender.packed", index=index, rank=rank.rank)
        with self._cond:
            rank.packed.add(index)
            self._cond.notify_all()

    def publisher_failed(self, run: VersionRun, error: WeightSyncError | pb.ErrorDetail) -> None:
        with self._cond:
            if run.staged_s or run.done:
                return
            detail = error if isinstance(error, pb.ErrorDetail) else error_to_pb(error)
            self._abort(run, detail)

    # ---- waiting ----

    def _wait_locked(self, run: VersionRun, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if run.done:
                raise RunAborted()
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncTimeoutError(
                    f"version {run.version}: waited {timeout_s:.0f} s for {what}"
                )
            self._cond.wait(min(left, 1.0))
        if run.done:
            raise RunAborted()

    def wait_applied(self, version: int, timeout_s: float) -> pb.VersionStatus:
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        with self._cond:
            run = self._runs.get(version)
            if run is None:
                raise VersionError(
                    f"version {version} is unknown to this sender (never published or "
                    f"dropped from its history of {self.settings.history})"
                )
            while not run.done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise SyncTimeoutError(
                        f"version {version} not applied by every receiver within {timeout_s} s; "
                        f"still pending: {run.active()}"
                    )
                self._cond.wait(1.0 if left is None else min(left, 1.0))
            return run.to_pb()

    def _watch_deadlines(self) -> None:
        # Its own clock, not the condition: waking on every ack would contend for the lock.
        while not self._stop.wait(0.2):
            while self._finished:
                log.info(*self._finished.popleft())
            with self._cond:
                now = time.monotonic()
                for run in list(self._runs.values()):
                    for rid, outcome in list(run.outcomes.items()):
                        if outcome.state == PENDING and outcome.deadline and outcome.deadline < now:
                            owed = ", ".join(sorted(outcome.awaiting))
                            self._fail(
                                run,
                                rid,
                                SyncTimeoutError(
                                    f"receiver {rid} sent nothing for "
                                    f"{self.settings.ack_timeout_s:.0f} s "
                                    f"during version {run.version} (owed: {owed})"
                                ),
                            )

    # ---- failure bookkeeping (lock held) ----

    def _fail(self, run: VersionRun, rid: str, error, notify: bool = True) -> None:
        detail = error if isinstance(error, pb.ErrorDetail) else error_to_pb(error)
        outcome = run.outcomes[rid]
        outcome.state, outcome.error, outcome.awaiting, outcome.deadline = (
            FAILED,
            detail,
            set(),
            None,
        )
        conn = self._receivers[rid]
        if conn.state == "applying":
            conn.state = "failed"
        conn.last_error = conn.last_error or detail.message
        for slot in self._slots:
            slot.readers.discard(rid)
            # A failed receiver's reads need not finish first (and if its process died, its
            # event might never complete): packing does not wait for them.
            slot.after = [
                w for w in slot.after if not (isinstance(w, ReadEvent) and w.receiver_id == rid)
            ]
        run.direct_readers.discard(rid)
        if notify:
            conn.send(pb.Announcement(abort=pb.VersionAbort(version=run.version, reason=detail)))
        self.metrics.receiver_failed(rid)
        self._maybe_complete(run)
        self._cond.notify_all()

    def _abort(self, run: VersionRun, detail: pb.ErrorDetail) -> None:
        if run.done:
            return
        for rid in run.active():
            self._fail(run, rid, detail)
        for slot in self._slots:
            if slot.version == run.version:
                slot.readers.clear()
        for rank in run.ranks.values():
            rank.outbox.put(WeightSyncError(f"version {run.version} abandoned: {detail.message}"))
        run.state = "failed"
        run.complete_s = time.monotonic() - run.started_mono
        self._cond.notify_all()

    def _release_reader(self, rid: str, version: int, index: int, read_event: bytes = b"") -> None:
        """The receiver queued its reads of bucket ``index``: packing into that slot again
        waits for ``read_event`` (empty: its reads are done)."""
        for slot in self._slots:
            if slot.version == version and slot.bucket_index == index and rid in slot.readers:
                if read_event:
                    event = self._events.get(read_event, torch.device(slot.device))
                    slot.after.append(ReadEvent(rid, event))
                slot.readers.discard(rid)

    def _maybe_complete(self, run: VersionRun) -> None:
        if run.state != "staged" or run.active():
            return
        run.complete_s = time.monotonic() - run.started_mono
        run.state = (
            "complete" if all(o.state == APPLIED for o in run.outcomes.values()) else "failed"
        )
        self.metrics.version_done(run)
        trace.mark("sender.complete", version=run.version)
        if run.notify_done:
            done = pb.SenderReply(done=run.to_pb())
            for rank in run.ranks.values():
                rank.outbox.put(done)
                rank.outbox.put(VERSION_OVER)
        applied = sum(o.state == APPLIED for o in run.outcomes.values())
        self._finished.append(
            (
                "version %d %s: %.1f MB (%.1f MB direct), %d bucket(s), staged %.3f s, "
                "done %.3f s, applied by %d/%d receiver(s)%s",
                run.version,
                run.state,
                run.manifest.total_bytes / 1e6,
                (run.direct.nbytes if run.direct else 0) / 1e6,
                len(run.plan.buckets),
                run.staged_s,
                run.complete_s,
                applied,
                len(run.outcomes),
                "".join(
                    f"; {rid} failed: {o.error.message}"
                    for rid, o in run.outcomes.items()
                    if o.state == FAILED
                ),
            )
        )

    # ---- status ----

    def status(self) -> pb.StatusReply:
        with self._cond:
            return pb.StatusReply(
                sender_version=__version__,
                transport=self.settings.transport,
                bucket_size_bytes=self.settings.bucket_size_bytes,
                num_buffers=self.settings.num_buffers,
                publishers=list(self._publishers.values()),
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
                    )
                    for c in sorted(self._receivers.values(), key=lambda c: c.receiver_id)
                ],
                versions=[run.to_pb() for run in self._runs.values()],
            )

    def run_of(self, version: int) -> VersionRun | None:
        with self._cond:
            return self._runs.get(version)

    @property
    def last_version(self) -> int:
        return self._last_version

    def close(self) -> None:
        self._stop.set()
        self._copies = (None, {})
        while self._finished:
            log.info(*self._finished.popleft())
        with self._cond:
            for run in self._runs.values():
                if not run.done:
                    self._abort(run, error_to_pb(TransportError("the sender is shutting down")))
            for conn in self._receivers.values():
                conn.outbox.put(None)
            for slot in self._slots:
                self._free(slot)
            self._slots = []
            self._broadcaster.close()
            self._cond.notify_all()


def _offer_key(ranks: dict[int, RankConn]) -> tuple[bytes, ...]:
    """What each rank offered (sources, pieces, direct or not; not the manifest), as bytes."""
    return tuple(
        pb.BeginVersion(
            sources=ranks[r].begin.sources,
            pieces=ranks[r].begin.pieces,
            allow_direct=ranks[r].begin.allow_direct,
        ).SerializeToString()
        for r in sorted(ranks)
    )


def _staging_device(rank: RankConn) -> torch.device:
    """Where rank 0's tensors live, as this process numbers GPUs (by UUID, since the trainer
    and the sender may see different ``CUDA_VISIBLE_DEVICES``)."""
    device = torch.device(rank.device)
    if device.type != "cuda" or not rank.begin_uuid:
        return device
    return torch.device("cuda", local_index_of(rank.begin_uuid, device.index or 0))
