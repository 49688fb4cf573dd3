"""What the publisher ranks of one version offered: their storages and where each tensor lives.

Pure: built from the ranks' ``BeginVersion`` messages, no mapping and no I/O (the sender maps
offered memory in ``packing.py``, only when the plan says it packs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from weightsync.buckets import TensorSpec
from weightsync.manifest import VersionManifest
from weightsync.v1 import weightsync_pb2 as pb

OfferKey = tuple[bytes, ...]
"""What each rank offered (sources, pieces, direct or not; not the manifest), as bytes."""


def offer_key(begins: Mapping[int, pb.BeginVersion]) -> OfferKey:
    """The :data:`OfferKey` of the ranks' begin messages (by rank)."""
    return tuple(
        pb.BeginVersion(
            sources=begins[r].sources,
            pieces=begins[r].pieces,
            allow_direct=begins[r].allow_direct,
        ).SerializeToString()
        for r in sorted(begins)
    )


@dataclass(frozen=True)
class Offer:
    sources: tuple[pb.BufferHandle, ...]
    """Every rank's storages, rank by rank (piece ``source`` indices are rebased onto it)."""
    pieces: tuple[tuple[int, pb.BeginVersion], ...]
    """Each rank's begin message with the index of its first source in ``sources``."""
    whole: Mapping[str, tuple[int, int]]
    """Tensors offered as one whole contiguous piece of their own dtype: (source, offset)."""

    @classmethod
    def of(cls, manifest: VersionManifest, begins: Mapping[int, pb.BeginVersion]) -> Offer:
        sources: list[pb.BufferHandle] = []
        pieces = []
        count: dict[str, int] = {}
        for rank in sorted(begins):
            begin = begins[rank]
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
        return cls(tuple(sources), tuple(pieces), whole)

    def covers(self, specs: Mapping[str, TensorSpec]) -> bool:
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
