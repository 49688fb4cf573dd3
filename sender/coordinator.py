"""The sender's coordinator: builds its parts, joins publisher ranks, plans and starts versions.

The parts, each given what it uses:

- :class:`~weightsync.sender.registry.Registry`: who is connected, ``Status``;
- :class:`~weightsync.sender.history.VersionHistory`: the last versions, ``WaitApplied``;
- :class:`~weightsync.sender.outcomes.Outcomes`: receivers' replies, failures across versions;
- :class:`~weightsync.sender.catch_ups.CatchUps`: late receivers, from their nearest copy;
- :class:`~weightsync.sender.slots.SlotPool`: the staging buffers;
- :func:`~weightsync.sender.planner.plan_version`: how a version travels (pure);
- :class:`~weightsync.sender.version.Version`: one planned version, taking its replies;
- :class:`~weightsync.sender.driver.VersionDriver`: runs each version, one at a time;
- :class:`~weightsync.transports.broadcast.SenderBroadcast`: the broadcast path's sender end.

One lock (an ``RLock`` condition) guards all state, handed to each part (to versions in
:class:`~weightsync.sender.outcomes.Shared`). A monitor thread fails receivers that owe a reply
past ``ack_timeout_s`` (a dead one never blocks the others) and starts catch-ups.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from weightsync import gc_pause, limits, trace
from weightsync.config import SenderSettings
from weightsync.errors import ConfigError, ReplacedError, WeightSyncError
from weightsync.manifest import VersionManifest
from weightsync.memo import Memo
from weightsync.metrics import SenderMetrics
from weightsync.sender.armed import ArmedStarts
from weightsync.sender.catch_ups import CatchUps
from weightsync.sender.direct_reads import DirectReads
from weightsync.sender.driver import VersionDriver
from weightsync.sender.hellos import check_publisher_hello, check_receiver_hello
from weightsync.sender.history import VersionHistory
from weightsync.sender.joins import StreamBegins, refused, staging_device
from weightsync.sender.offer import OfferKey
from weightsync.sender.outcomes import Outcomes, Shared
from weightsync.sender.packing import MappedOffers
from weightsync.sender.planner import Staging, TensorPlans, plan_version
from weightsync.sender.records import PublisherConn, RankConn, ReceiverConn
from weightsync.sender.registry import Registry
from weightsync.sender.reports import log_line
from weightsync.sender.slots import SlotPool
from weightsync.sender.version import Version
from weightsync.transports import resolve_transport
from weightsync.transports.broadcast import SenderBroadcast, host_id
from weightsync.transports.broadcast.slices import SlicePlans
from weightsync.transports.cuda_ipc import device_uuid
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import ManifestCache, error_to_pb

log = logging.getLogger("weightsync.sender")

_Joining = tuple[VersionManifest, int, dict[int, RankConn]]
"""A version whose publisher ranks are still joining: its manifest, world size, ranks so far."""


class Coordinator:
    """What the gRPC servicer calls: publisher ranks joining, receivers' messages, queries."""

    def __init__(self, settings: SenderSettings, metrics: SenderMetrics) -> None:
        self.settings = settings
        self._cond = threading.Condition()
        slots = SlotPool(settings.num_buffers, settings.bucket_size_bytes)
        self.history = VersionHistory(self._cond, settings.history)
        self.registry = Registry(self._cond, settings, metrics, self.history, host_id())
        self._shared = Shared(self._cond, settings, metrics, slots, self.registry, deque())
        self._catch_ups = CatchUps(self._shared, self.history)
        self._outcomes = Outcomes(self._shared, self.history, self._catch_ups)
        self._armed = ArmedStarts(self._shared, self.history, self._catch_ups)
        self._broadcast = SenderBroadcast(
            settings.broadcast_host,
            settings.ack_timeout_s,
            self._cond,
            self.registry.broadcast_members,
            self.registry.receiver,
            settings.delta_bytes,
        )
        self._driver = VersionDriver(self._shared, self._broadcast)
        self._joining: dict[tuple[str, int], _Joining] = {}  # by (publisher id, version)
        # Caches; each says its key and what invalidates it.
        self._manifests = ManifestCache()
        """Parsed manifests by their bytes without the version; cleared when 16 are held."""
        self._tensor_plans = TensorPlans()
        """Tensor plans by (manifest, offer, direct, bucket size); the last 4 are kept."""
        self._direct_reads = DirectReads()
        self._slice_plans = SlicePlans()
        """Each receiver's direct bucket by (tensor plan, receivers' GPUs); the last 4."""
        self._mapped_offers = MappedOffers()
        """Offered memory mapped here, by offer; the last 4 are kept (cleared at close)."""
        self._bounded: Memo[tuple[bytes, OfferKey], None] = Memo(16)
        """(Manifest key, offer key) pairs checked against ``limits``; the last 16 used."""
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch_deadlines, daemon=True)
        self._monitor.start()

    # ---- publishers ----

    def publisher_connected(self, hello: pb.PublisherHello) -> PublisherConn:
        """A publisher rank's stream said hello: check it (ConfigError naming the field) and
        count the rank as connected until :meth:`publisher_left`."""
        check_publisher_hello(hello)
        return self.registry.publisher_connected(hello)

    def publisher_left(self, conn: PublisherConn, why: str) -> None:
        self.registry.publisher_left(conn, why)

    def join(
        self,
        hello: pb.PublisherHello,
        begin: pb.BeginVersion,
        outbox: queue.Queue,
        begins: StreamBegins,
    ) -> tuple[Version | None, RankConn]:
        """Add one publisher rank to a version (its replies go to ``outbox``, the rank's
        stream; ``begins``: the begins the stream sent by ``begin_key``); the last rank to join
        plans the version and starts its driver.

        Raises:
            WeightSyncError: the begin is refused; any other exception becomes a ConfigError
                (INVALID_ARGUMENT) naming the hello's and begin's fields. Nothing is left
                behind: not the rank, not the version; ranks that had joined the version are
                told it is abandoned.
        """
        with refused(
            f"publisher {hello.publisher_id!r} rank {hello.rank} could not begin version "
            f"{begin.manifest.version}",
            f"PublisherHello (device {hello.device!r}, device_uuid {hello.device_uuid!r}) and "
            "BeginVersion (manifest, sources, pieces)",
        ):
            return self._join(hello, begin, outbox, begins)

    def _join(
        self,
        hello: pb.PublisherHello,
        begin: pb.BeginVersion,
        outbox: queue.Queue,
        begins: StreamBegins,
    ) -> tuple[Version | None, RankConn]:
        manifest, kept = begins.take(begin, hello.device_uuid, self._manifests)
        trace.mark("sender.begin", version=manifest.version, rank=hello.rank)
        world = max(hello.world_size, 1)
        manifest_key, offer = kept.manifest_key, kept.offer
        with self._cond:
            self.history.check_version(manifest.version)
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
                hello.rank,
                hello.device,
                kept.begin,
                device_uuid=hello.device_uuid,
                outbox=outbox,
                offer=offer,
                wait_applied=begin.wait_applied,
                staged_in_done=begin.wait_applied and hello.staged_in_done,
            )
            ranks[hello.rank] = conn
            if len(ranks) < world:
                return None, conn
            hold = gc_pause.Hold()  # released when the version ends
            joined_at, joined_mono = time.time(), time.monotonic()
            try:
                with self._armed.ahead(ranks, hello.publisher_id, manifest_key, manifest.version):
                    device = staging_device(ranks[min(ranks)])
                    run = self._plan_run(manifest, manifest_key, hello.publisher_id, device, ranks)
            except BaseException as e:
                hold.release()
                self._abandon_joining(key, conn, e)
                raise
            run.started_at, run.started_mono = joined_at, joined_mono
            run.plan_s = time.monotonic() - joined_mono
            run.gc_hold = hold
            del self._joining[key]
            self.history.add_run(run)
            self._catch_ups.planned(run, device)
            trace.mark("sender.planned", version=run.version)
            # Queued under the lock: no catch-up slips between a version sent ahead and its start.
            self._driver.launch(run, device)
        return run, conn

    def _abandon_joining(self, key: tuple[str, int], failed: RankConn, e: BaseException):
        """Lock held: planning a version whose ranks had all joined failed. Nothing of it is
        kept; every other rank's stream ends with the error (the failing rank's caller
        answers its own)."""
        _, _, ranks = self._joining.pop(key)
        why = f"version {key[1]} abandoned: it could not be planned: {type(e).__name__}: {e}"
        for rank in ranks.values():
            if rank is not failed:
                rank.outbox.put(WeightSyncError(why))

    def rank_left(self, hello: pb.PublisherHello, version: int, conn: RankConn | None) -> None:
        """A rank's stream ended: it packs nothing more, and if it was still waiting for the
        other ranks of ``version``, it no longer counts as joined (a rank that comes back
        joins again)."""
        with self._cond:
            if conn is not None:
                conn.left = True
                self._cond.notify_all()
            entry = self._joining.get((hello.publisher_id, version))
            if conn is None or entry is None or entry[2].get(conn.rank) is not conn:
                return
            del entry[2][conn.rank]
            if not entry[2]:
                del self._joining[(hello.publisher_id, version)]

    def _plan_run(
        self,
        manifest: VersionManifest,
        manifest_key: bytes,
        publisher_id: str,
        device: torch.device,
        ranks: dict[int, RankConn],
    ) -> Version:
        """Plan the version (lock held), set each receiver's data path, and map the offered
        memory when the sender packs."""
        transport = resolve_transport(self.settings.transport, device)
        begins = {rank: conn.begin for rank, conn in ranks.items()}
        gpus = {rank: conn.device_uuid for rank, conn in ranks.items()}
        offered = tuple(ranks[r].offer for r in sorted(ranks))

        def check_limits() -> None:
            # Before anything is planned from or mapped for them; once per pair.
            size = self.settings.bucket_size_bytes
            limits.check_entries(len(manifest.tensors), manifest.total_bytes, size)
            for begin in begins.values():
                limits.check_offer(begin)

        self._bounded.get((manifest_key, offered), check_limits)
        plan = plan_version(
            manifest,
            begins,
            self.registry.receivers(),
            self.settings,
            Staging(transport, device_uuid(device)),
            self._tensor_plans.memo(manifest_key, offered),
            gpus,
            self._direct_reads,
            self._slice_plans,
        )
        self.registry.set_data_paths(plan.data_paths)
        self.registry.staging_uuid = device_uuid(device)
        regions = None
        if plan.tensors.sender_packs:
            # One copy of each piece: the staging GPU's is chosen (offered fixes it).
            regions = self._mapped_offers.regions(offered, plan.tensors.pack_from)
        return Version(
            manifest,
            plan.tensors,
            publisher_id,
            transport,
            ranks,
            regions=regions,
            notify_done=any(conn.wait_applied for conn in ranks.values()),
            direct_reads=plan.direct_reads,
            route_bytes=plan.route_bytes,
            slices=plan.slices,
            manifest_key=manifest_key,
            shared=self._shared,
        )

    def on_packed(self, run: Version, rank: RankConn, packed: pb.BucketPacked) -> None:
        """A publisher rank packed its part of a bucket of ``run`` (one of an earlier version:
        ignored).

        Raises:
            ConfigError: the index is no staged bucket of the version.
        """
        if packed.version != run.version:
            return
        staged = len(run.tensors.staged.buckets)
        if packed.index >= staged:
            raise ConfigError(
                f"BucketPacked.index {packed.index} is not a staged bucket of version "
                f"{run.version}, which has {staged}"
            )
        trace.mark("sender.publisher_packed", index=packed.index, rank=rank.rank)
        with self._cond:
            rank.packed.add(packed.index)
            self._cond.notify_all()

    def publisher_failed(self, run: Version, error: WeightSyncError | pb.ErrorDetail) -> None:
        """A publisher rank failed or left: the version is abandoned unless already staged."""
        with self._cond:
            if run.staged_s or run.done:
                return
            run.abort(error if isinstance(error, pb.ErrorDetail) else error_to_pb(error))

    # ---- receivers and queries ----

    def add_receiver(self, hello: pb.ReceiverHello) -> ReceiverConn:
        """Register a receiver (ConfigError naming the field; nothing registered) and start
        its catch-up if it is behind. An id already connected is taken over: its old stream
        ends (ReplacedError) and fails what it owed."""
        check_receiver_hello(hello)
        with (
            refused(
                f"receiver {hello.receiver_id!r} could not register",
                f"ReceiverHello (engine {hello.engine!r}, device {hello.device!r}, "
                f"transports {list(hello.transports)}, host_id {hello.host_id!r})",
            ),
            self._cond,
        ):
            old = self.registry.connected(hello.receiver_id)
            if old is not None:
                old.outbox.put(
                    ReplacedError(
                        f"receiver id {old.receiver_id!r} was registered again from another "
                        "connection (a restarted engine takes its id back); this stream is "
                        "closed and does not register again"
                    )
                )
                self._outcomes.receiver_left(old, "replaced: its id registered again")
            conn = self.registry.add_receiver(hello)
            catch_up = self._catch_ups.joined(conn)
        if catch_up is not None:
            self._driver.launch(*catch_up)
        return conn

    def receiver_gone(self, conn: ReceiverConn, why: str) -> None:
        self._outcomes.receiver_left(conn, why)

    def on_receiver_message(self, conn: ReceiverConn, msg: pb.ReceiverMessage) -> None:
        self._outcomes.on_receiver_message(conn, msg)

    def status(self) -> pb.StatusReply:
        """The registry's Status, its oldest versions dropped while it is over
        ``limits.STATUS_REPLY_BUDGET_BYTES`` (every string in it is bounded, this bounds
        their count)."""
        reply = self.registry.status()
        with self._cond:
            reply.catch_ups.extend(self._catch_ups.statuses())
        while reply.versions and reply.ByteSize() > limits.STATUS_REPLY_BUDGET_BYTES:
            del reply.versions[: max(1, len(reply.versions) // 4)]
        return reply

    def wait_applied(
        self, version: int, timeout_s: float, alive: Callable[[], bool] = lambda: True
    ) -> pb.VersionStatus:
        return self.history.wait_applied(version, timeout_s, alive)

    def run_of(self, version: int) -> Version | None:
        return self.history.run_of(version)

    @property
    def last_version(self) -> int:
        return self.history.last_version

    # ---- lifecycle ----

    def _watch_deadlines(self) -> None:
        # Its own clock, not the condition: waking on every ack would contend for the lock.
        while not self._stop.wait(0.2):
            self._log_finished()
            with self._cond:
                self._outcomes.expire(time.monotonic())

    def _log_finished(self) -> None:
        while self._shared.finished:
            run, abandoned = self._shared.finished.popleft()
            line = log_line(run, abandoned)
            log.info("%s", line.message, extra=line.extra)
            with self._cond:
                catch_ups = self._catch_ups.finished(run)
            for catch_up in catch_ups:
                self._driver.launch(*catch_up)

    def close(self) -> None:
        self._stop.set()
        self._log_finished()
        with self._cond:
            self.history.close()
            self._outcomes.close()
            self.registry.close()
            self._shared.slots.close_all()
            self._mapped_offers.clear()
            self._broadcast.close()
            self._cond.notify_all()
        self._driver.close()
