"""Each receiver's own direct bucket: every direct tensor read from its nearest copy.

Pure: a function of the tensor plan (the whole copies every rank offered) and the GPUs of the
receivers that map. Which copy each receiver reads is :func:`weightsync.topology.plan_topology`'s
choice (the planner ``weightsync plan`` shares): the copy on the receiver's own GPU, else one on
a peer GPU, the bytes balanced over the source GPUs so no one GPU's outbound link bounds the
node. Where a copy on its own GPU holds all a receiver needs of a tensor, that choice is made
without the planner (the same choice, in a fraction of the time: a large MoE model on a
node); where such copies hold only part of it (a TP trainer's shard), that part is read there
and the planner plans only the rest. A tensor no rank holds whole is read as the pieces that
hold what the receiver needs (box entries, :attr:`~weightsync.buckets.BucketEntry.box_start`),
each whole, in box order.

A receiver maps every storage its announcement lists, so each gets only the storages it reads.
A receiver that declared the boxes it keeps (an engine TP rank: ``ManifestVerdict.keeps``) is
planned for those: its route bytes count its shard, and its entries stay whole tensors or
pieces, which its own loaders narrow as they copy (so only the shard's bytes move).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightsync.buckets import TensorSpec, direct_entry
from weightsync.memo import Memo, Same
from weightsync.sender.offer import Copy
from weightsync.topology import Box, Piece, Receiver, Source, cells, plan_topology, whole_box
from weightsync.topology_model import Keeps, fits
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import entry_to_pb

if TYPE_CHECKING:
    from weightsync.sender.planner import TensorPlan

_HOST = "this host"
"""Every reader here maps the publishers' memory, so it is on the publishers' host."""
_WHOLE = 1 << 62
"""``split_min_bytes`` that never splits: a layout entry is a whole tensor."""

ReceiverGpus = tuple[tuple[str, str], ...]
"""(receiver id, GPU UUID) of every receiver that reads direct, sorted."""


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
    tensors: TensorPlan,
    receivers: ReceiverGpus,
    keeps: Keeps | None = None,
    *,
    shortcut: bool = True,
) -> dict[str, DirectRead]:
    """Every receiver's :class:`DirectRead` (none when nothing goes direct); ``keeps``: the
    boxes each receiver declared (a receiver not in it keeps every tensor whole).

    A receiver with no GPU UUID, or on a GPU no copy is on, reads from peers; an empty tensor
    from its lowest rank's copies (nothing moves, the planner leaves it out). ``shortcut``
    False: every read is planned by :func:`plan_topology`, none found on the receiver's own GPU
    first (the same reads, slower: what the shortcut is tested against).
    """
    direct = tensors.direct
    if direct is None or not receivers:
        return {}
    specs = tensors.direct_specs
    offered = _Offered(specs, tensors.copies)
    keeps = keeps or {}
    at = [(rid, gpu or f"receiver {rid}") for rid, gpu in receivers]
    chosen, routes, planned = _on_own_gpu(specs, offered, at, keeps, shortcut)
    if planned:
        readers = [Receiver(rid, gpu, _HOST, needs) for (rid, gpu), needs in planned.items()]
        plan = plan_topology(specs, offered.sources(), readers, split_min_bytes=_WHOLE)
        for t in plan.transfers:  # by receiver, manifest order, box, source rank
            routes[t.receiver][t.route] += t.nbytes
            read = chosen[t.receiver].setdefault(t.tensor, [])
            for c in offered.held[t.tensor, t.source]:
                if c.box.overlaps(t.box) and not any(c is r for r in read):
                    read.append(c)
    for mine in chosen.values():  # in box order, however they were found
        for read in mine.values():
            if len(read) > 1:
                read.sort(key=lambda c: (c.box, c.rank))
    reads = {}
    # Each entry made once: receivers on other GPUs read their own copies at the same offsets
    # (DP replicas), and making an entry costs more than finding it.
    made: dict[tuple, pb.BucketEntry] = {}
    for rid, _ in receivers:
        index: dict[int, int] = {}  # the offer's source index -> this receiver's
        entries = []
        mine = chosen[rid]
        for spec in specs:
            for c in mine.get(spec.name) or offered.lowest_copies(spec.name):
                source = index.get(c.source)
                if source is None:
                    source = index[c.source] = len(index)
                what = (spec.name, c.box.start, c.box.size, c.offset, source)
                entry = made.get(what)
                if entry is None:
                    entry = made[what] = entry_to_pb(direct_entry(*located(spec, c, source)))
                entries.append(entry)
        layout = pb.BucketLayout(
            index=direct.index,
            is_last=direct.is_last,
            nbytes=sum(e.nbytes for e in entries),
            entries=entries,
        )
        sources_read = tuple(tensors.direct_sources[i] for i in index)
        digest = hashlib.blake2b(layout.SerializeToString(), digest_size=16)
        for handle in sources_read:
            digest.update(handle.SerializeToString())
        reads[rid] = DirectRead(layout, sources_read, routes[rid], digest.digest())
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


class _Offered:
    """The direct tensors' copies, indexed for :func:`plan_direct_reads`."""

    def __init__(self, specs: Sequence[TensorSpec], copies: Mapping[str, Sequence[Copy]]):
        self.copies = copies
        self.held: dict[tuple[str, int], list[Copy]] = defaultdict(list)
        """Each rank's copies of each tensor."""
        self.gpu_of: dict[int, str] = {}
        self.lowest: dict[tuple[str, Box, str], int] = {}
        """(tensor, box, GPU) -> the lowest rank holding that box there."""
        self.holders: dict[str, dict[Box, tuple[int, ...]]] = {}
        """The ranks holding each distinct box offered of each tensor (by rank), as the
        planner sees them. No two boxes overlap: a direct tensor's copies are whole, or
        pieces that tile it (:class:`Offer`)."""
        self._lowest_copies: dict[str, list[Copy]] = {}
        self._cells: dict[tuple[str, Box], list[tuple[Box, dict[str, int], Piece]]] = {}
        for spec in specs:
            boxes: dict[Box, list[int]] = {}
            for c in copies[spec.name]:  # by rank
                self.held[spec.name, c.rank].append(c)
                # CPU copies: a GPU no receiver is on.
                gpu = self.gpu_of.setdefault(c.rank, c.gpu or f"rank {c.rank}")
                if c.box.numel:
                    ranks = boxes.setdefault(c.box, [])
                    if not ranks or ranks[-1] != c.rank:
                        ranks.append(c.rank)
                    self.lowest.setdefault((spec.name, c.box, gpu), c.rank)
            self.holders[spec.name] = {b: tuple(ranks) for b, ranks in boxes.items()}

    def lowest_copies(self, name: str) -> list[Copy]:
        hit = self._lowest_copies.get(name)
        if hit is None:
            hit = self._lowest_copies[name] = lowest_copies(self.copies[name])
        return hit

    def copies_in(self, name: str, rank: int, box: Box) -> list[Copy]:
        """``rank``'s copies of ``name`` that meet ``box`` (which it holds), in a list of its
        own: the planned reads append to it."""
        held = self.held[name, rank]
        return list(held) if len(held) == 1 else [c for c in held if c.box.overlaps(box)]

    def split(
        self, spec: TensorSpec, need: Box, gpu: str
    ) -> tuple[list[Copy], int, list[Piece]] | None:
        """``need`` of ``spec`` as the planner cuts it (:func:`~weightsync.topology.cells`):
        the copies of its cells held on ``gpu`` (each the lowest rank's there, the planner's
        choice), their elements, and the other cells as pieces to plan (shared by receivers,
        so equal lists are walked once). None where the planner must see ``need`` whole, to
        name what is wrong: a cell no rank holds, a box outside the tensor."""
        name = spec.name
        cut = self._cells.get((name, need))
        if cut is None:
            cut = self._cells[name, need] = self._cut(spec, need)
        if not cut:
            return None
        copies: list[Copy] = []  # a list of its own: the planned reads append to it
        elements, planned = 0, []
        for cell, lowest, piece in cut:
            rank = lowest.get(gpu)
            if rank is None:
                planned.append(piece)
                continue
            elements += cell.numel
            for c in self.copies_in(name, rank, cell):  # cells of one box read it once
                if not any(c is r for r in copies):
                    copies.append(c)
        return copies, elements, planned

    def _cut(self, spec: TensorSpec, need: Box) -> list[tuple[Box, dict[str, int], Piece]]:
        """Each cell of ``need``, the lowest rank holding it on each GPU, and the cell as a
        piece to plan (the planner cuts a cell into itself: every box that meets it holds it
        whole, or it joins boxes of its very holders); [] where a cell is held by no rank or
        ``need`` is not a box of the tensor (the planner names either)."""
        name, holders = spec.name, self.holders[spec.name]
        ranks = holders.get(need)  # mostly the need is an offered box
        if ranks:
            return [(need, self._lowest(ranks), Piece(name, need))]
        if not fits(need.start, need.size, spec.shape):
            return []
        out = []
        for cell, ranks in cells(need, holders):
            if not ranks:
                return []
            out.append((cell, self._lowest(ranks), Piece(name, cell)))
        return out

    def _lowest(self, ranks: Sequence[int]) -> dict[str, int]:
        """The lowest of ``ranks`` (sorted) on each GPU."""
        lowest: dict[str, int] = {}
        for r in ranks:
            lowest.setdefault(self.gpu_of[r], r)
        return lowest

    def sources(self) -> list[Source]:
        """Every rank as the planner's source (DP replicas share piece objects: its memo)."""
        pieces: dict[int, list[Piece]] = defaultdict(list)
        shared: dict[tuple[str, Box], Piece] = {}
        for (name, rank), held in self.held.items():
            for c in held:
                piece = shared.get((name, c.box)) or Piece(name, c.box)
                pieces[rank].append(shared.setdefault((name, c.box), piece))
        return [Source(rank, self.gpu_of[rank], _HOST, tuple(ps)) for rank, ps in pieces.items()]


def _on_own_gpu(
    specs: Sequence[TensorSpec],
    offered: _Offered,
    receivers: Sequence[tuple[str, str]],
    keeps: Keeps,
    shortcut: bool = True,
) -> tuple[
    dict[str, dict[str, list[Copy]]],
    dict[str, dict[str, int]],
    dict[tuple[str, str], tuple[Piece, ...]],
]:
    """The reads of every tensor whose needed box (``keeps``, else the whole tensor) lies in
    the one offered box that meets it, held on the receiver's own GPU: the lowest rank's copy
    there, as :func:`plan_topology` would choose (a local read loads no link another choice
    depends on), found without it. DP replicas and engine ranks that keep their trainer rank's
    shard read all they need so, and a large MoE model's plan takes seconds less. Where copies
    on its GPU hold only part of the need (whole engines of a TP trainer), that part is read
    so and only the rest planned (:meth:`_Offered.split`).

    Returns, by receiver id, the copies read of each tensor found so and the bytes by route;
    and what is left to plan, by (receiver id, GPU): the pieces of every tensor it needs that
    the planner reads (receivers with nothing left are not listed; equal lists are one tuple,
    which the planner walks once).
    """
    whole = {s.name: Piece(s.name, whole_box(s.shape)) for s in specs}
    chosen: dict[str, dict[str, list[Copy]]] = {}
    routes: dict[str, dict[str, int]] = {}
    planned: dict[tuple[str, str], tuple[Piece, ...]] = {}
    interned: dict[tuple[int, ...], tuple[Piece, ...]] = {}  # by the pieces' identities
    for rid, gpu in receivers:
        declared = keeps.get(rid) or {}
        mine: dict[str, list[Copy]] = {}
        local = 0
        left: list[Piece] = []
        for spec in specs:
            box = declared.get(spec.name)
            need = box or whole[spec.name].box
            if not need.numel:
                continue  # nothing moves: it reads the lowest rank's copies
            # Mostly the need is an offered box, and one rank on this GPU holds it.
            rank = offered.lowest.get((spec.name, need, gpu)) if shortcut else None
            if rank is not None:
                local += need.numel * (spec.nbytes // spec.numel)
                mine[spec.name] = offered.copies_in(spec.name, rank, need)
                continue
            split = offered.split(spec, need, gpu) if shortcut else None
            if split is None:
                left.append(Piece(spec.name, box) if box else whole[spec.name])
                continue
            copies, elements, rest = split
            if copies:
                mine[spec.name] = copies
                local += elements * (spec.nbytes // spec.numel)
            left += rest
        chosen[rid], routes[rid] = mine, {"local": local, "peer": 0}
        if left:
            planned[rid, gpu] = interned.setdefault(tuple(map(id, left)), tuple(left))
    return chosen, routes, planned


class DirectReads:
    """Memo of :func:`plan_direct_reads`. Key: the tensor plan and each receiver's declared
    boxes (by identity: the tensor plans' memo keeps a plan while its layout is in use, a
    receiver's record replaces its boxes only when they change) and the receivers' GPUs; the
    last ``max_entries`` are kept."""

    def __init__(self, max_entries: int = 4) -> None:
        self._reads: Memo[tuple[Same, ReceiverGpus], dict[str, DirectRead]] = Memo(max_entries)

    def __call__(
        self, tensors: TensorPlan, receivers: ReceiverGpus, keeps: Keeps | None = None
    ) -> dict[str, DirectRead]:
        keeps = keeps or {}
        return self._reads.get(
            (Same(tensors, *(keeps.get(rid) for rid, _ in receivers)), receivers),
            lambda: plan_direct_reads(tensors, receivers, keeps),
        )
