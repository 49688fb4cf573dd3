"""Each receiver's own direct bucket: every direct tensor read from its nearest copy.

Pure: a function of the tensor plan (the whole copies every rank offered) and the GPUs of the
receivers that map. Which copy each receiver reads is :func:`weightsync.topology.plan_topology`'s
choice (the planner ``weightsync plan`` shares): the copy on the receiver's own GPU, else one on
a peer GPU, the bytes balanced over the source GPUs so no one GPU's outbound link bounds the
node. A tensor no rank holds whole is read as the pieces that hold what the receiver needs
(box entries, :attr:`~weightsync.buckets.BucketEntry.box_start`), each whole.

A receiver maps every storage its announcement lists, so each gets only the storages it reads.
A receiver that declared the boxes it keeps (an engine TP rank: ``ManifestVerdict.keeps``) is
planned for those: its route bytes count its shard, and its entries stay whole tensors or
pieces, which its own loaders narrow as they copy (so only the shard's bytes move).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightsync.buckets import TensorSpec, plan_direct
from weightsync.sender.offer import Copy
from weightsync.topology import Box, Piece, Receiver, Source, plan_topology, whole_box
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import bucket_to_pb

if TYPE_CHECKING:
    from weightsync.sender.planner import TensorPlan

_HOST = "this host"
"""Every reader here maps the publishers' memory, so it is on the publishers' host."""
_WHOLE = 1 << 62
"""``split_min_bytes`` that never splits: a layout entry is a whole tensor."""

ReceiverGpus = tuple[tuple[str, str], ...]
"""(receiver id, GPU UUID) of every receiver that reads direct, sorted."""
Keeps = Mapping[str, Mapping[str, Box]]
"""By receiver id: the boxes it declared it keeps of tensors it keeps only part of."""


@dataclass(frozen=True)
class DirectRead:
    """One receiver's direct bucket."""

    layout: pb.BucketLayout
    """The direct tensors, each at its copy's offset in ``sources``."""
    sources: tuple[pb.BufferHandle, ...]
    """Only the storages this receiver reads."""
    route_bytes: Mapping[str, int]
    """Bytes by route: "local" (a copy on its own GPU) and "peer" (another GPU)."""
    key: bytes = b""
    """An id of ``layout`` and ``sources`` (``BucketAnnouncement.layout_key``)."""


def plan_direct_reads(
    tensors: TensorPlan, receivers: ReceiverGpus, keeps: Keeps | None = None
) -> dict[str, DirectRead]:
    """Every receiver's :class:`DirectRead` (none when nothing goes direct); ``keeps``: the
    boxes each receiver declared (a receiver not in it keeps every tensor whole).

    A receiver with no GPU UUID, or on a GPU no copy is on, reads from peers; an empty tensor
    from its lowest rank's copies (nothing moves, the planner leaves it out).
    """
    direct = tensors.direct
    if direct is None or not receivers:
        return {}
    specs = tensors.direct_specs
    pieces: dict[int, list[Piece]] = defaultdict(list)
    gpu_of: dict[int, str] = {}
    held: dict[tuple[str, int], list[Copy]] = defaultdict(list)
    for spec in specs:
        shared: dict[Box, Piece] = {}  # DP replicas share piece objects (the planner's memo)
        for c in tensors.copies[spec.name]:
            piece = shared.get(c.box) or shared.setdefault(c.box, Piece(spec.name, c.box))
            pieces[c.rank].append(piece)
            held[spec.name, c.rank].append(c)
            gpu_of[c.rank] = c.gpu or f"rank {c.rank}"  # CPU copies: none is a receiver's GPU
    sources = [Source(rank, gpu_of[rank], _HOST, tuple(ps)) for rank, ps in pieces.items()]
    keeps = keeps or {}
    readers = [
        Receiver(rid, gpu or f"receiver {rid}", _HOST, _needs(specs, keeps.get(rid)))
        for rid, gpu in receivers
    ]
    plan = plan_topology(specs, sources, readers, split_min_bytes=_WHOLE)
    chosen: dict[str, dict[str, list[tuple[Box, int, str, int]]]] = defaultdict(dict)
    for t in plan.transfers:
        chosen[t.receiver].setdefault(t.tensor, []).append((t.box, t.source, t.route, t.nbytes))
    reads = {}
    for rid, _ in receivers:
        index: dict[int, int] = {}  # the offer's source index -> this receiver's
        entries = []
        routes = {"local": 0, "peer": 0}
        for spec in specs:
            read: dict[Copy, None] = {}  # the copies holding what it reads, in plan order
            for box, rank, route, nbytes in chosen[rid].get(spec.name, ()):
                routes[route] += nbytes
                read.update((c, None) for c in held[spec.name, rank] if c.box.overlaps(box))
            for c in read or lowest_copies(tensors.copies[spec.name]):
                entries.append(located(spec, c, index.setdefault(c.source, len(index))))
        bucket = plan_direct(entries, direct.index, direct.is_last)
        sources_read = tuple(tensors.direct_sources[i] for i in index)
        layout = bucket_to_pb(bucket)
        digest = hashlib.blake2b(layout.SerializeToString(), digest_size=16)
        for handle in sources_read:
            digest.update(handle.SerializeToString())
        reads[rid] = DirectRead(layout, sources_read, routes, digest.digest())
    return reads


def lowest_copies(copies: Sequence[Copy]) -> list[Copy]:
    """The lowest rank's copy of each box (``copies`` come by rank)."""
    first: dict[Box, Copy] = {}
    for c in copies:
        first.setdefault(c.box, c)
    return list(first.values())


def located(
    spec: TensorSpec, copy: Copy, source: int | None = None
) -> tuple[TensorSpec, int, int, tuple[int, ...]]:
    """The direct entry reading ``copy`` of ``spec`` (:func:`~weightsync.buckets.plan_direct`),
    from ``source`` (default: the copy's own index in the offer)."""
    source = copy.source if source is None else source
    if copy.box.size == spec.shape:  # a whole copy: a plain entry
        return spec, source, copy.offset, ()
    return TensorSpec(spec.name, spec.dtype, copy.box.size), source, copy.offset, copy.box.start


def _needs(specs: list, boxes: Mapping[str, Box] | None) -> tuple[Piece, ...]:
    """A receiver's pieces: every direct tensor, whole or the box it declared (none declared:
    the planner's default, every tensor whole)."""
    if not boxes:
        return ()
    return tuple(Piece(s.name, boxes.get(s.name) or whole_box(s.shape)) for s in specs)


class DirectReads:
    """Memo of :func:`plan_direct_reads`. Key: the tensor plan and each receiver's declared
    boxes (by identity: the tensor plans' memo keeps a plan while its layout is in use, a
    receiver's record replaces its boxes only when they change) and the receivers' GPUs; the
    last ``max_entries`` are kept."""

    def __init__(self, max_entries: int = 4) -> None:
        self._max = max_entries
        self._reads: OrderedDict[tuple, tuple[tuple, dict[str, DirectRead]]] = OrderedDict()

    def __call__(
        self, tensors: TensorPlan, receivers: ReceiverGpus, keeps: Keeps | None = None
    ) -> dict[str, DirectRead]:
        keeps = keeps or {}
        held = (tensors, *(keeps.get(rid) for rid, _ in receivers))
        key = (tuple(map(id, held)), receivers)
        hit = self._reads.get(key)
        if hit is None or any(a is not b for a, b in zip(hit[0], held, strict=True)):
            hit = self._reads[key] = (held, plan_direct_reads(tensors, receivers, keeps))
            while len(self._reads) > self._max:
                self._reads.popitem(last=False)
        self._reads.move_to_end(key)
        return hit[1]
