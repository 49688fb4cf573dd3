"""What the publisher ranks of one version offered: their storages and where each tensor lives.

Pure: built from the ranks' ``BeginVersion`` messages and the GPU each rank is on, no mapping
and no I/O (the sender maps offered memory in ``packing.py``, only when the plan says it packs).

Several ranks may offer the same tensor (DP replicas): every copy is kept, so receivers can each
read their nearest one (``direct_reads.py``), while staging packs from one copy only. A tensor
no rank holds whole can still be read in place when contiguous pieces of it tile it (TP shards,
Megatron's query groups): receivers then read its pieces.
Every publisher rank is on the sender's host (it offers memory the sender maps), so a copy's
place is its GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from weightsync.buckets import TensorSpec
from weightsync.manifest import VersionManifest
from weightsync.topology_model import Box, fits, whole_box
from weightsync.v1 import weightsync_pb2 as pb

OfferKey = tuple[bytes, ...]
"""What each rank offered (sources, pieces, direct or not, its GPU; not the manifest), as
bytes."""


def rank_offer(begin: pb.BeginVersion, gpu: str) -> bytes:
    """One rank's part of the :data:`OfferKey`. The sender computes it as each rank joins,
    on that rank's own stream thread, so the last rank to join does not serialize every
    rank's offer (a millisecond for four ranks of a 7B model) before the version can start."""
    offered = pb.BeginVersion(
        sources=begin.sources,
        pieces=begin.pieces,
        allow_direct=begin.allow_direct,
        ready=begin.ready,
    )
    return offered.SerializeToString() + gpu.encode()


@dataclass(frozen=True)
class Copy:
    """A contiguous copy, in its own dtype, of a box of a tensor (the whole tensor, or a piece
    of it) in a rank's storage."""

    rank: int
    source: int
    """Index into :attr:`Offer.sources`."""
    offset: int
    gpu: str
    """The rank's GPU UUID (empty for CPU memory)."""
    box: Box
    """The whole tensor's box for a whole copy."""


@dataclass(frozen=True)
class Offer:
    sources: tuple[pb.BufferHandle, ...]
    """Every rank's storages, rank by rank (a copy's ``source`` indexes it)."""
    direct: Mapping[str, tuple[Copy, ...]]
    """Tensors that can be read in place, with every copy to read them from, by rank: the
    whole copies where a rank holds one, else contiguous pieces that tile the tensor."""
    pack_from: Mapping[int, pb.BeginVersion]
    """The begin messages with one piece per box of each tensor (DP replicas offer the same
    boxes: one copy is packed, the one on ``staging_gpu``, else the lowest rank's); ranks left
    with no piece are left out (their memory need not be mapped)."""

    @classmethod
    def of(
        cls,
        manifest: VersionManifest,
        begins: Mapping[int, pb.BeginVersion],
        gpus: Mapping[int, str] | None = None,
        staging_gpu: str = "",
    ) -> Offer:
        gpus = gpus or {}
        sources: list[pb.BufferHandle] = []
        specs = {t.name: t for t in manifest.tensors}
        whole: dict[str, list[Copy]] = {}
        parts: dict[str, list[Copy]] = {}
        # (tensor, box) -> (preference, rank, piece): the copy staging packs from.
        chosen: dict[tuple, tuple[tuple[bool, int], int, pb.SourcePiece]] = {}
        # DP replicas offer equal pieces (their storages differ): each list is read once.
        read: dict[bytes, list[_Piece]] = {}
        boxes: dict[tuple, Box] = {}  # one object per box: later plans hash and compare less
        for rank in sorted(begins):
            begin, base, gpu = begins[rank], len(sources), gpus.get(rank, "")
            sources.extend(begin.sources)
            payload = pb.BeginVersion(pieces=begin.pieces).SerializeToString()
            pieces = read.get(payload)
            if pieces is None:
                pieces = read[payload] = [_Piece.of(p, specs, boxes) for p in begin.pieces]
            for piece in pieces:
                preference = (not (staging_gpu and gpu == staging_gpu), rank)
                if piece.key not in chosen or preference < chosen[piece.key][0]:
                    chosen[piece.key] = (preference, rank, piece.msg)
                if piece.box is None:
                    continue
                copy = Copy(rank, base + piece.source, piece.offset, gpu, piece.box)
                (whole if piece.whole else parts).setdefault(piece.name, []).append(copy)
        kept: dict[int, list[pb.SourcePiece]] = {}
        for _, rank, p in chosen.values():
            kept.setdefault(rank, []).append(p)
        pack_from = {
            rank: pb.BeginVersion(
                sources=begins[rank].sources, pieces=kept[rank], ready=begins[rank].ready
            )
            for rank in sorted(kept)
        }
        direct = {n: tuple(c) for n, c in whole.items()}
        for name, copies in parts.items():
            if name not in direct and _tiles(specs[name].shape, {c.box for c in copies}):
                direct[name] = tuple(copies)
        return cls(tuple(sources), direct, pack_from)

    def covers(self, specs: Mapping[str, TensorSpec]) -> bool:
        """Whether the pieces staging packs from fit their tensors and add up to every tensor
        of ``specs`` (the publishers guarantee one rank's pieces do not overlap; Megatron
        proves it at construction; copies of equal boxes were reduced to one)."""
        left = {name: spec.numel for name, spec in specs.items()}
        for begin in self.pack_from.values():
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


@dataclass(frozen=True)
class _Piece:
    """One offered piece as :meth:`Offer.of` uses it."""

    msg: pb.SourcePiece
    key: tuple
    """(tensor, start, size): pieces of equal keys are copies of one box."""
    name: str
    source: int
    offset: int
    box: Box | None
    """None: it cannot be read in place (not a tensor of the manifest, another dtype, not
    contiguous, or outside its tensor: then the pieces fail ``covers``)."""
    whole: bool

    @classmethod
    def of(
        cls, p: pb.SourcePiece, specs: Mapping[str, TensorSpec], boxes: dict[tuple, Box]
    ) -> _Piece:
        start, size = tuple(p.dst_start), tuple(p.size)
        key = (p.name, start, size)
        spec = specs.get(p.name)
        box = None
        if (
            spec is not None
            and p.dtype == spec.dtype
            and _contiguous(size, tuple(p.stride))
            and (size == spec.shape or fits(start, size, spec.shape))
        ):
            box = boxes.get(key)
            if box is None:
                box = boxes[key] = whole_box(spec.shape) if size == spec.shape else Box(start, size)
        return cls(p, key, p.name, p.source, p.offset, box, box is not None and size == spec.shape)


def _tiles(shape: tuple[int, ...], boxes: set[Box]) -> bool:
    """Whether ``boxes`` (distinct: DP replicas' equal boxes count once) cover every element
    of a tensor of ``shape`` once: inside it, no two overlapping, their sizes adding up."""
    whole = whole_box(shape)
    if not all(whole.contains(b) for b in boxes) or sum(b.numel for b in boxes) != whole.numel:
        return False
    # A sweep over dim 0: only boxes whose row ranges meet can overlap.
    ordered = sorted(boxes)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b.start[0] >= a.stop[0]:
                break
            if a.overlaps(b):
                return False
    return True


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Row-major contiguous (strides of size-1 dims do not matter, as in torch)."""
    step = 1
    for n, s in zip(reversed(shape), reversed(stride), strict=True):
        if n != 1 and s != step:
            return False
        step *= n
    return True
