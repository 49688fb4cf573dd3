"""How one version travels: a pure function of (manifest, offers, receivers, settings).

:func:`plan_version` decides, without I/O or locks,

- each receiver's data path: ``map`` the staging buffers, or receive ``broadcast`` s;
- which tensors receivers read in place from the publishers' memory (the direct bucket) and
  which are staged, and the staged bucket plan with every bucket's wire layout;
- whether the sender packs the staged buckets itself from the offered memory (else the
  publishers pack, one round trip per bucket).

The tensor part depends only on the layout (manifest tensors, offer, direct or not), so the
coordinator memoizes it with :class:`TensorPlans` and reuses it every version.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightsync.buckets import Bucket, BucketPlan, plan_buckets, plan_direct
from weightsync.config import SenderSettings
from weightsync.manifest import VersionManifest
from weightsync.sender.offer import Offer, OfferKey
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import bucket_to_pb

if TYPE_CHECKING:
    from weightsync.sender.records import ReceiverConn

MAP, BROADCAST = "map", "broadcast"


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
    """Wire form of every bucket, by index (the direct bucket last)."""
    sender_packs: bool
    """The offered regions cover every staged tensor: the sender can pack every bucket."""


@dataclass(frozen=True)
class Plan:
    data_paths: Mapping[str, str]
    """Receiver id -> :data:`MAP` or :data:`BROADCAST`, for every receiver given."""
    tensors: TensorPlan


PlanTensors = Callable[[VersionManifest, Mapping[int, pb.BeginVersion], bool, int], TensorPlan]


def plan_version(
    manifest: VersionManifest,
    offers: Mapping[int, pb.BeginVersion],
    receivers: Sequence[ReceiverConn],
    settings: SenderSettings,
    staging: Staging,
    tensors_of: PlanTensors | None = None,
) -> Plan:
    """The plan of one version; ``offers`` are the publisher ranks' begin messages by rank.

    Tensors go direct only when a publisher allows it, the sender stages with CUDA IPC and
    every connected receiver maps. ``tensors_of``: :func:`plan_tensors` (default) or its memo.
    """
    paths = data_paths(receivers, settings.transport, staging.device_uuid)
    direct = (
        any(b.allow_direct for b in offers.values())
        and staging.transport == "cuda_ipc"
        and all(paths[c.receiver_id] == MAP for c in receivers if c.connected)
    )
    tensors = (tensors_of or plan_tensors)(manifest, offers, direct, settings.bucket_size_bytes)
    return Plan(paths, tensors)


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
) -> TensorPlan:
    """Stage every tensor, except, when ``direct``, those offered whole (read in place)."""
    offer = Offer.of(manifest, offers)
    located = offer.whole if direct else {}
    staged = tuple(t for t in manifest.tensors if t.name not in located)
    plan = plan_buckets(staged, bucket_size_bytes)
    if located and not staged:
        plan = BucketPlan((), (), plan.bucket_size_bytes)  # not even an empty bucket
    direct_bucket = None
    if located:
        direct_bucket = plan_direct(
            [(t, *located[t.name]) for t in manifest.tensors if t.name in located],
            index=len(plan.buckets),
            is_last=not plan.buckets,
        )
    layouts = tuple(bucket_to_pb(b) for b in (*plan.buckets, direct_bucket) if b)
    specs = {e.spec.name: e.spec for b in plan.buckets for e in b.entries}
    sender_packs = bool(plan.buckets) and offer.covers(specs)
    return TensorPlan(plan, direct_bucket, offer.sources, layouts, sender_packs)


class TensorPlans:
    """Memo of :func:`plan_tensors`. Key: (manifest key, offer key, direct, bucket size);
    the last ``max_entries`` layouts are kept (a trainer alternates few)."""

    def __init__(self, max_entries: int = 4) -> None:
        self._max = max_entries
        self._plans: OrderedDict[tuple, TensorPlan] = OrderedDict()

    def memo(self, manifest_key: bytes, offer: OfferKey) -> PlanTensors:
        """:func:`plan_tensors` for the manifest and offer these keys stand for."""

        def planned(manifest, offers, direct: bool, bucket_size_bytes: int) -> TensorPlan:
            key = (manifest_key, offer, direct, bucket_size_bytes)
            hit = self._plans.get(key)
            if hit is None:
                hit = self._plans[key] = plan_tensors(manifest, offers, direct, bucket_size_bytes)
                while len(self._plans) > self._max:
                    self._plans.popitem(last=False)
            self._plans.move_to_end(key)
            return hit

        return planned
