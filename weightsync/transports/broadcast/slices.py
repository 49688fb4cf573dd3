"""Buckets of boxes for broadcast receivers that keep only part of each tensor.

An engine rank on another host gets its bytes by broadcast. When it declared the boxes it
keeps (``ManifestVerdict.keeps``: its TP shard, as its own loaders slice each tensor), sending
it every tensor whole wastes its link on the other ranks' shards: for a model served at TP=32,
31/32 of what crosses. So broadcast receivers that keep the same boxes form a slice group (the
same TP rank of every replica) with buckets holding only those boxes, broadcast in a group of
their own: each box crosses once per group. Receivers that keep everything whole, and those
that map the staging buffers, get the staged buckets as before.

Pure: a function of the staged tensors, the receivers' declared boxes, the bucket cap and the
first free bucket index (slice buckets are numbered after the version's others, so acks and
checksums stay one index space).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from weightsync.buckets import BucketPlan, TensorSpec, plan_buckets
from weightsync.memo import Memo, Same
from weightsync.topology_model import Box, Keeps, whole_box
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import bucket_to_pb


class TensorPlan(Protocol):
    """What slicing needs of a version's tensor plan (``sender.planner.TensorPlan``)."""

    staged: BucketPlan
    layouts: Sequence[pb.BucketLayout]


@dataclass(frozen=True)
class SliceGroup:
    """Broadcast receivers that keep the same boxes, and the buckets of those boxes."""

    members: tuple[str, ...]
    """Receiver ids, sorted."""
    plan: BucketPlan
    """Every staged tensor's box (whole where they keep it whole), in staging order."""
    layouts: tuple[pb.BucketLayout, ...]
    """Wire form of ``plan``'s buckets."""


def plan_slices(staged: BucketPlan, keeps: Keeps, first_index: int) -> tuple[SliceGroup, ...]:
    """The slice groups of the broadcast receivers in ``keeps`` (by receiver id) for the
    ``staged`` tensors; a receiver that keeps all of them whole is in none."""
    specs = staged.manifest
    by_boxes: dict[tuple[tuple[str, Box], ...], list[str]] = {}
    for rid in sorted(keeps):
        boxes = keeps[rid]
        partial = tuple(
            sorted(
                (s.name, boxes[s.name])
                for s in specs
                if s.name in boxes and boxes[s.name] != whole_box(s.shape)
            )
        )
        if partial:
            by_boxes.setdefault(partial, []).append(rid)
    groups = []
    index = first_index
    for partial, members in by_boxes.items():
        boxes = dict(partial)
        sliced = [
            TensorSpec(s.name, s.dtype, boxes[s.name].size) if s.name in boxes else s for s in specs
        ]
        starts = {name: box.start for name, box in partial}
        plan = plan_buckets(sliced, staged.bucket_size_bytes, first_index=index, box_starts=starts)
        index += len(plan.buckets)
        groups.append(
            SliceGroup(tuple(members), plan, tuple(bucket_to_pb(b) for b in plan.buckets))
        )
    return tuple(groups)


class SlicePlans:
    """Memo of :func:`plan_slices`. Key: the tensor plan and each receiver's declared boxes
    (by identity: a receiver's record replaces its boxes only when they change); the last
    ``max_entries`` are kept."""

    def __init__(self, max_entries: int = 4) -> None:
        self._plans: Memo[tuple[Same, tuple[str, ...]], tuple[SliceGroup, ...]] = Memo(max_entries)

    def __call__(self, tensors: TensorPlan, keeps: Keeps) -> tuple[SliceGroup, ...]:
        rids = tuple(sorted(keeps))
        return self._plans.get(
            (Same(tensors, *(keeps[rid] for rid in rids)), rids),
            lambda: plan_slices(tensors.staged, keeps, len(tensors.layouts)),
        )
