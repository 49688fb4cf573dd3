"""What the publishers of one version offered: their storages and where each tensor lives.

Worked out once per (manifest, offer) and cached by the coordinator: which tensors receivers
may read in place (one whole contiguous piece), the bucket plan with and without them, and
the regions mapped into the sender so it can pack the staged buckets itself.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from weightsync.sender.runs import RankConn

from weightsync.buckets import Bucket, BucketPlan, TensorSpec, plan_buckets, plan_direct
from weightsync.errors import ProtocolError, TransportError
from weightsync.manifest import VersionManifest
from weightsync.regions import Region
from weightsync.transports import MappedBuffers
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import bucket_to_pb, regions_from_pb

log = logging.getLogger("weightsync.sender")


@dataclass(frozen=True)
class Planned:
    """How one version travels: staged buckets, the direct bucket, their wire layouts (by
    index, the direct one last), and the offered regions when the sender packs itself."""

    plan: BucketPlan
    direct: Bucket | None
    layouts: tuple[pb.BucketLayout, ...]
    regions: Mapping[str, Sequence[Region]] | None


@dataclass
class Offer:
    tensors: tuple[TensorSpec, ...]
    """The manifest's tensors, in order."""
    sources: tuple[pb.BufferHandle, ...]
    """Every rank's storages, rank by rank (piece ``source`` indices are rebased onto it)."""
    pieces: tuple[tuple[int, pb.BeginVersion], ...]
    """Each rank's begin message with the index of its first source in ``sources``."""
    whole: dict[str, tuple[int, int]]
    """Tensors offered as one whole contiguous piece of their own dtype: (source, offset)."""
    _planned: dict[bool, Planned] = field(default_factory=dict)
    _buffers: MappedBuffers = field(default_factory=MappedBuffers)
    """The storages mapped here, for as long as the coordinator caches this offer."""

    @classmethod
    def of(cls, manifest: VersionManifest, ranks: Mapping[int, RankConn]) -> Offer:
        sources: list[pb.BufferHandle] = []
        pieces = []
        count: dict[str, int] = {}
        for rank in sorted(ranks):
            begin = ranks[rank].begin
            pieces.append((len(sources), begin))
            sources.extend(begin.sources)
            for p in begin.pieces:
                count[p.name] = count.get(p.name, 0) + 1
        specs = {t.name: t for t in manifest.tensors}
        whole = {}
        for base, begin in pieces:
            for p in begin.pieces:
                spec = specs.get(p.name)
                if spec is None or count[p.name] != 1 or p.dtype != spec.dtype:
                    continue
                if tuple(p.size) == spec.shape and _contiguous(spec.shape, tuple(p.stride)):
                    whole[p.name] = (base + p.source, p.offset)
        return cls(manifest.tensors, tuple(sources), tuple(pieces), whole)

    def planned(self, direct: bool, bucket_size_bytes: int) -> Planned:
        """The version's plan, with the :attr:`whole` tensors read in place when ``direct``
        (else staged too), and the offered regions mapped here if they cover every staged
        tensor (else None: the publishers pack). Worked out once per value of ``direct``."""
        if direct not in self._planned:
            located = self.whole if direct else {}
            staged = tuple(t for t in self.tensors if t.name not in located)
            plan = plan_buckets(staged, bucket_size_bytes)
            if located and not staged:
                plan = BucketPlan((), (), plan.bucket_size_bytes)  # not even an empty bucket
            direct_bucket = None
            if located:
                direct_bucket = plan_direct(
                    [(t, *located[t.name]) for t in self.tensors if t.name in located],
                    index=len(plan.buckets),
                    is_last=not plan.buckets,
                )
            layouts = tuple(bucket_to_pb(b) for b in (*plan.buckets, direct_bucket) if b)
            regions = self._map(plan) if plan.buckets else None
            self._planned[direct] = Planned(plan, direct_bucket, layouts, regions)
        return self._planned[direct]

    def _map(self, plan: BucketPlan) -> Mapping[str, Sequence[Region]] | None:
        specs = {e.spec.name: e.spec for b in plan.buckets for e in b.entries}
        if not self._covers(specs):
            return None
        regions: dict[str, list[Region]] = {}
        try:
            for _, begin in self.pieces:
                mapped = [self._buffers.get(h) for h in begin.sources]
                for name, parts in regions_from_pb(begin.pieces, mapped).items():
                    regions.setdefault(name, []).extend(parts)
        except (TransportError, ProtocolError) as e:
            log.warning("the publishers pack: their offered memory does not map here (%s)", e)
            return None
        return regions

    def _covers(self, specs: Mapping[str, TensorSpec]) -> bool:
        """Whether the pieces fit their tensors and add up to every tensor of ``specs`` (the
        publishers guarantee they do not overlap; Megatron proves it at construction)."""
        left = {name: spec.numel for name, spec in specs.items()}
        for _, begin in self.pieces:
            for p in begin.pieces:
                spec = specs.get(p.name)
                if spec is None:
                    continue
                if len(p.dst_start) != len(spec.shape) or len(p.size) != len(spec.shape):
                    return False
                ends = (a + n for a, n in zip(p.dst_start, p.size, strict=True))
                if any(a < 0 for a in p.dst_start) or any(
                    e > n for e, n in zip(ends, spec.shape, strict=True)
                ):
                    return False
                left[p.name] -= math.prod(p.size)
        return not any(left.values())


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Row-major contiguous (strides of size-1 dims do not matter, as in torch)."""
    step = 1
    for n, s in zip(reversed(shape), reversed(stride), strict=True):
        if n != 1 and s != step:
            return False
        step *= n
    return True
