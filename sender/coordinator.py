"""The sender's coordinator: builds its parts, joins publisher ranks, plans and starts versions.

The parts, each given what it uses:

- :class:`~weightsync.sender.registry.Registry`: receivers, publishers, versions, failures;
- :class:`~weightsync.sender.slots.SlotPool`: the staging buffers;
- :func:`~weightsync.sender.planner.plan_version`: how a version travels (pure);
- :class:`~weightsync.sender.driver.VersionDriver`: executes a plan, one version at a time;
- :class:`~weightsync.sender.broadcast.SenderBroadcast`: the broadcast data path.

One lock (an ``RLock`` condition) guards all state; the coordinator makes it and hands it to
each part. A monitor thread fails receivers that owe a reply past ``ack_timeout_s``, so a dead
or stalled receiver never blocks the others.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from weightsync import trace
from weightsync.config import SenderSettings
from weightsync.errors import ConfigError, WeightSyncError
from weightsync.manifest import VersionManifest
from weightsync.metrics import SenderMetrics
from weightsync.sender.broadcast import SenderBroadcast
from weightsync.sender.driver import VersionDriver
from weightsync.sender.offer import offer_key
from weightsync.sender.packing import MappedOffers
from weightsync.sender.planner import Staging, TensorPlans, plan_version
from weightsync.sender.records import RankConn, ReceiverConn, VersionRun
from weightsync.sender.registry import Registry
from weightsync.sender.slots import Slot, SlotPool
from weightsync.transports import resolve_transport
from weightsync.transports.broadcast import host_id
from weightsync.transports.cuda_ipc import device_uuid, local_index_of
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
        self._slots = SlotPool(settings.num_buffers, settings.bucket_size_bytes)
        self.registry = Registry(self._cond, settings, metrics, self._slots, host_id())
        self._broadcast = SenderBroadcast(
            settings.broadcast_host, settings.ack_timeout_s, self._cond, self.registry
        )
        self._driver = VersionDriver(
            self._cond, settings, metrics, self.registry, self._slots, self._broadcast
        )
        self._joining: dict[tuple[str, int], _Joining] = {}
        """By (publisher id, version)."""
        # Caches; each says its key and what invalidates it.
        self._manifests = ManifestCache()
        """Parsed manifests by their bytes without the version; cleared when 16 are held."""
        self._tensor_plans = TensorPlans()
        """Tensor plans by (manifest, offer, direct, bucket size); the last 4 are kept."""
        self._mapped_offers = MappedOffers()
        """Offered memory mapped here, by offer; the last 4 are kept (cleared at close)."""
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch_deadlines, daemon=True)
        self._monitor.start()

    # ---- publishers ----

    def join(
        self, hello: pb.PublisherHello, begin: pb.BeginVersion, outbox: queue.Queue
    ) -> tuple[VersionRun | None, RankConn]:
        """Add one publisher rank to a version (its replies go to ``outbox``, the rank's
        stream); the last rank to join plans the version and starts its driver."""
        manifest, manifest_key = self._manifests(begin.manifest)
        trace.mark("sender.begin", version=manifest.version, rank=hello.rank)
        world = max(hello.world_size, 1)
        if hello.rank >= world:
            raise ConfigError(f"publisher rank {hello.rank} is not below world_size {world}")
        with self._cond:
            self.registry.check_version(manifest.version)
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
                hello.rank, hello.device, begin, device_uuid=hello.device_uuid, outbox=outbox
            )
            ranks[hello.rank] = conn
            self.registry.publisher_joined(
                pb.PublisherStatus(
                    publisher_id=hello.publisher_id,
                    ranks_connected=len(ranks),
                    world_size=world,
                    device=hello.device,
                )
            )
            if len(ranks) < world:
                return None, conn
            del self._joining[key]
            device = _staging_device(ranks[min(ranks)])
            run = self._plan_run(manifest, manifest_key, hello.publisher_id, device, ranks)
            self.registry.add_run(run)
        self._driver.start(run, device)
        return run, conn

    def _plan_run(
        self,
        manifest: VersionManifest,
        manifest_key: bytes,
        publisher_id: str,
        device: torch.device,
        ranks: dict[int, RankConn],
    ) -> VersionRun:
        """Plan the version (lock held), set each receiver's data path, and map the offered
        memory when the sender packs."""
        transport = resolve_transport(self.settings.transport, device)
        begins = {rank: conn.begin for rank, conn in ranks.items()}
        offered = offer_key(begins)
        plan = plan_version(
            manifest,
            begins,
            self.registry.receivers(),
            self.settings,
            Staging(transport, device_uuid(device)),
            self._tensor_plans.memo(manifest_key, offered),
        )
        self.registry.set_data_paths(plan.data_paths)
        regions = None
        if plan.tensors.sender_packs:
            regions = self._mapped_offers.regions(offered, begins)
        return VersionRun(
            manifest,
            plan.tensors,
            publisher_id,
            transport,
            ranks,
            regions=regions,
            notify_done=any(b.wait_applied for b in begins.values()),
        )

    def on_packed(self, run: VersionRun, rank: RankConn, index: int) -> None:
        """A publisher rank packed its part of bucket ``index``."""
        trace.mark("sender.publisher_packed", index=index, rank=rank.rank)
        with self._cond:
            rank.packed.add(index)
            self._cond.notify_all()

    def publisher_failed(self, run: VersionRun, error: WeightSyncError | pb.ErrorDetail) -> None:
        """A publisher rank failed or left: the version is abandoned unless already staged."""
        with self._cond:
            if run.staged_s or run.done:
                return
            detail = error if isinstance(error, pb.ErrorDetail) else error_to_pb(error)
            self.registry.abort(run, detail)

    # ---- receivers and queries (the registry's) ----

    def add_receiver(self, hello: pb.ReceiverHello) -> ReceiverConn:
        return self.registry.add_receiver(hello)

    def receiver_gone(self, conn: ReceiverConn, why: str) -> None:
        self.registry.receiver_gone(conn, why)

    def on_receiver_message(self, conn: ReceiverConn, msg: pb.ReceiverMessage) -> None:
        self.registry.on_receiver_message(conn, msg)

    def status(self) -> pb.StatusReply:
        return self.registry.status()

    def wait_applied(self, version: int, timeout_s: float) -> pb.VersionStatus:
        return self.registry.wait_applied(version, timeout_s)

    def run_of(self, version: int) -> VersionRun | None:
        return self.registry.run_of(version)

    @property
    def last_version(self) -> int:
        return self.registry.last_version

    def staging_slots(self) -> tuple[Slot, ...]:
        """The staging slots now allocated (their buffers: ``slot.buffer``)."""
        with self._cond:
            return self._slots.slots

    # ---- lifecycle ----

    def _watch_deadlines(self) -> None:
        # Its own clock, not the condition: waking on every ack would contend for the lock.
        while not self._stop.wait(0.2):
            self._log_finished()
            with self._cond:
                self.registry.expire(time.monotonic())

    def _log_finished(self) -> None:
        while self.registry.finished:
            log.info(*self.registry.finished.popleft())

    def close(self) -> None:
        self._stop.set()
        self._log_finished()
        self.registry.close()
        with self._cond:
            self._slots.close()
            self._mapped_offers.clear()
            self._broadcast.close()
            self._cond.notify_all()


def _staging_device(rank: RankConn) -> torch.device:
    """Where rank 0's tensors live, as this process numbers GPUs (by UUID, since the trainer
    and the sender may see different ``CUDA_VISIBLE_DEVICES``)."""
    device = torch.device(rank.device)
    if device.type != "cuda" or not rank.device_uuid:
        return device
    return torch.device("cuda", local_index_of(rank.device_uuid, device.index or 0))
