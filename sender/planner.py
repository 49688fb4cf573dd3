"""How one version travels: a pure function of (manifest, offers, receivers, settings).

:func:`plan_version` decides, without I/O or locks,

- each receiver's data path: ``map`` the staging buffers, or receive ``broadcast`` s;
- which tensors receivers read in place from the publishers' memory (the direct bucket) and
  which are staged, and the staged bucket plan with every bucket's wire layout;
- whether the sender packs the staged buckets itself from the offered memory (else the
  publishers pack, one round trip per bucket), from one copy of each tensor;
- each mapping receiver's own direct bucket, every tensor from its nearest copy
  (``direct_reads.py``), and the bytes each route carries.

The tensor part depends only on the layout (manifest tensors, offer, direct or not), so the
coordinator memoizes it with :class:`TensorPlans` and reuses it every version; the direct
reads depend on it and the receivers' GPUs (memo: :class:`~weightsync.sender.direct_reads.
DirectReads`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightsync.buckets import Bucket, BucketPlan, TensorSpec, plan_buckets, plan_direct
from weightsync.config import SenderSettings
from weightsync.errors import PlanError
from weightsync.manifest import VersionManifest
from weightsync.memo import Memo
from weightsync.regions import entry_rows
from weightsync.sender.direct_reads import (
    DirectRead,
    ReceiverGpus,
    located,
    lowest_copies,
    plan_direct_reads,
)
from weightsync.sender.offer import Copy, Offer, OfferKey
from weightsync.topology_model import Keeps
from weightsync.transports.broadcast.slices import SliceGroup, plan_slices
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import bucket_to_pb

if TYPE_CHECKING:
    from weightsync.sender.records import ReceiverConn

MAP, BROADCAST = "map", "broadcast"
ROUTES = ("local", "peer", "staged", "broadcast")
"""How bytes reach receivers: direct from a copy on the receiver's GPU, direct from another
GPU, through the mapped staging buffers, by broadcast."""


@dataclass(frozen=True)
class Staging:
    """Where the sender stages a version: its transport and the staging GPU's UUID."""

    transport: str
    """The resolved staging transport: "cuda_ipc" or "shm"."""
    device_uuid: str = ""
    """Empty for CPU staging."""


@dataclass(frozen=True)
class TensorPlan:
    """How every tensor of one layout travels."""

    staged: BucketPlan
    """The staged tensors in size-capped buckets (no bucket when every tensor is direct)."""
    direct: Bucket | None
    """Tensors receivers copy straight from the publishers' storages (``direct_sources``);
    its index follows the staged buckets'."""
    direct_sources: tuple[pb.BufferHandle, ...]
    layouts: tuple[pb.BucketLayout, ...]
    """Wire form of every bucket, by index (the direct bucket last: each tensor from its
    lowest rank's copy, for a receiver that has no :class:`DirectRead` of its own)."""
    sender_packs: bool
    """The offered regions cover every staged tensor: the sender can pack every bucket."""
    copies: Mapping[str, tuple[Copy, ...]]
    """Every copy of each direct tensor: whole, or pieces that tile it."""
    pack_from: Mapping[int, pb.BeginVersion]
    """The offer reduced to one copy of each piece: what the sender maps and packs from."""
    direct_specs: tuple[TensorSpec, ...]
    """The direct tensors, in manifest order."""


@dataclass(frozen=True)
class Plan:
    data_paths: Mapping[str, str]
    """Receiver id -> :data:`MAP` or :data:`BROADCAST`, for every receiver given."""
    tensors: TensorPlan
    direct_reads: Mapping[str, DirectRead]
    """Each connected receiver's own direct bucket (none when nothing goes direct)."""
    route_bytes: Mapping[str, int]
    """Bytes every connected receiver together takes by each of :data:`ROUTES`."""
    slices: tuple[SliceGroup, ...] = ()
    """Broadcast receivers that keep only boxes, grouped by those boxes (``slices.py``)."""


PlanTensors = Callable[
    [VersionManifest, Mapping[int, pb.BeginVersion], bool, int, Mapping[int, str], str],
    TensorPlan,
]
PlanReads = Callable[[TensorPlan, ReceiverGpus, Keeps], Mapping[str, DirectRead]]
PlanSlices = Callable[[TensorPlan, Keeps], tuple[SliceGroup, ...]]


def plan_version(
    manifest: VersionManifest,
    offers: Mapping[int, pb.BeginVersion],
    receivers: Sequence[ReceiverConn],
    settings: SenderSettings,
    staging: Staging,
    tensors_of: PlanTensors | None = None,
    gpus: Mapping[int, str] | None = None,
    reads_of: PlanReads | None = None,
    slices_of: PlanSlices | None = None,
) -> Plan:
    """The plan of one version; ``offers`` are the publisher ranks' begin messages by rank,
    ``gpus`` their GPUs' UUIDs by rank.

    Tensors go direct only when a publisher allows it, the sender stages with CUDA IPC and
    every connected receiver maps. ``tensors_of``: :func:`plan_tensors` (default) or its memo;
    ``reads_of``: :func:`~weightsync.sender.direct_reads.plan_direct_reads` or its memo;
    ``slices_of``: :func:`~weightsync.transports.broadcast.slices.plan_slices` (the default) or
    its memo.
    Broadcast receivers get slices only where the sender packs (it packs their boxes from the
    offered regions; a publisher packs whole buckets only).
    """
    paths = data_paths(receivers, settings.transport, staging.device_uuid)
    connected = [c for c in receivers if c.connected]
    # Receivers cannot wait for pieces still being written (ready events): the sender packs.
    direct = (
        any(b.allow_direct for b in offers.values())
        and not any(b.ready for b in offers.values())
        and staging.transport == "cuda_ipc"
        and all(paths[c.receiver_id] == MAP for c in connected)
    )
    tensors = (tensors_of or plan_tensors)(
        manifest, offers, direct, settings.bucket_size_bytes, gpus or {}, staging.device_uuid
    )
    reads: Mapping[str, DirectRead] = {}
    if tensors.direct is not None:
        at = tuple(sorted((c.receiver_id, c.device_uuid) for c in connected))
        keeps = {c.receiver_id: c.keeps for c in connected if c.keeps}
        reads = (reads_of or plan_direct_reads)(tensors, at, keeps)
    slices: tuple[SliceGroup, ...] = ()
    keeps = {
        c.receiver_id: c.keeps for c in connected if c.keeps and paths[c.receiver_id] == BROADCAST
    }
    if keeps and tensors.sender_packs:
        slices = (slices_of or _plan_slices)(tensors, keeps)
    sliced = {rid: g.plan.total_bytes for g in slices for rid in g.members}
    routes = dict.fromkeys(ROUTES, 0)
    for read in reads.values():
        for route, n in read.route_bytes.items():
            routes[route] += n
    for c in connected:
        routes["staged" if paths[c.receiver_id] == MAP else "broadcast"] += sliced.get(
            c.receiver_id, tensors.staged.total_bytes
        )
    return Plan(paths, tensors, reads, routes, slices)


def _plan_slices(tensors: TensorPlan, keeps: Keeps) -> tuple[SliceGroup, ...]:
    return plan_slices(tensors.staged, keeps, len(tensors.layouts))


def data_paths(
    receivers: Sequence[ReceiverConn], transport: str, staging_uuid: str
) -> dict[str, str]:
    """Map the staging buffers where possible, else receive broadcasts.

    Receivers on another host always get broadcasts; with ``transport=nccl`` so does every
    receiver except one on the staging GPU itself, which NCCL cannot put in a group with the
    sender (two ranks on one GPU).
    """
    paths = {}
    for conn in receivers:
        on_staging_gpu = bool(staging_uuid) and conn.device_uuid == staging_uuid
        broadcast = conn.remote or (transport == "nccl" and not on_staging_gpu)
        paths[conn.receiver_id] = BROADCAST if broadcast else MAP
    return paths


def plan_tensors(
    manifest: VersionManifest,
    offers: Mapping[int, pb.BeginVersion],
    direct: bool,
    bucket_size_bytes: int,
    gpus: Mapping[int, str] | None = None,
    staging_gpu: str = "",
) -> TensorPlan:
    """Stage every tensor, except, when ``direct``, those offered whole (read in place).
    ``gpus``: each rank's GPU UUID; staging packs from the copies on ``staging_gpu`` first."""
    offer = Offer.of(manifest, offers, gpus, staging_gpu)
    copies = offer.direct if direct else {}
    staged = tuple(t for t in manifest.tensors if t.name not in copies)
    plan = plan_buckets(staged, bucket_size_bytes)
    if copies and not staged:
        plan = BucketPlan((), (), plan.bucket_size_bytes)  # not even an empty bucket
    direct_bucket = None
    direct_specs = tuple(t for t in manifest.tensors if t.name in copies)
    if copies:
        direct_bucket = plan_direct(
            [located(t, c) for t in direct_specs for c in lowest_copies(copies[t.name])],
            index=len(plan.buckets),
            is_last=not plan.buckets,
        )
    layouts = tuple(bucket_to_pb(b) for b in (*plan.buckets, direct_bucket) if b)
    specs = {e.spec.name: e.spec for b in plan.buckets for e in b.entries}
    sender_packs = bool(plan.buckets) and offer.covers(specs) and _whole_rows(plan)
    return TensorPlan(
        plan,
        direct_bucket,
        offer.sources,
        layouts,
        sender_packs,
        copies,
        offer.pack_from,
        direct_specs,
    )


def _whole_rows(plan: BucketPlan) -> bool:
    """Whether every staged chunk is a range of whole dim-0 rows: the sender packs offered
    regions row by row, so a row wider than a bucket (split mid-row, protocol §5 rule 3) is
    left to the publishers' ``pack``."""
    try:
        for bucket in plan.buckets:
            for entry in bucket.entries:
                entry_rows(entry)
    except PlanError:
        return False
    return True


class TensorPlans:
    """Memo of :func:`plan_tensors`. Key: (manifest key, offer key, direct, bucket size,
    staging GPU); the last ``max_entries`` layouts are kept (a trainer alternates few)."""

    def __init__(self, max_entries: int = 4) -> None:
        self._plans: Memo[tuple, TensorPlan] = Memo(max_entries)

    def memo(self, manifest_key: bytes, offer: OfferKey) -> PlanTensors:
        """:func:`plan_tensors` for the manifest and offer these keys stand for."""

        def planned(
            manifest, offers, direct: bool, bucket_size_bytes: int, gpus=None, staging_gpu=""
        ) -> TensorPlan:
            # The offer key says each rank's GPU too (``rank_offer``).
            return self._plans.get(
                (manifest_key, offer, direct, bucket_size_bytes, staging_gpu),
                lambda: plan_tensors(
                    manifest, offers, direct, bucket_size_bytes, gpus, staging_gpu
                ),
            )

        return planned
