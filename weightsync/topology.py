"""The topology planner: which source copy each receiver reads each needed box of each tensor from.

Pure code (no torch, no I/O): a plan is a function of (manifest, sources, receivers, link rates),
so the senders, ``weightsync plan`` and the tests all run the same code.

- **Sources** are trainer ranks; each holds boxes of HF tensors (a TP shard, a PP stage's layers,
  a DP replica's copy), on one GPU of one host.
- **Receivers** are engine ranks; each needs boxes of HF tensors (an engine TP rank keeps its
  shard), or, declaring nothing, every tensor whole.
- **The rule.** Each needed box is cut where the sources' boxes begin and end, so every cell is
  held whole by a fixed set of sources. Each cell is read from its nearest copy: same GPU
  (``local``) > same host (``peer``) > another host (``remote``). Among equally near copies,
  bytes are balanced over the source GPUs' links: largest cells first, each to the candidate
  whose links would finish earliest (ties by GPU uuid, then rank); peer reads per receiver and
  set of copies, so GPUs pair up (copy engines are fastest between pairs). A remote cell of at
  least ``split_min_bytes`` with several equally near copies is cut into dim-0 row ranges first,
  so one large tensor can come from several hosts' NICs at once.
- **Hosts and broadcast.** Cross-host bytes go over the GPUs' NICs. Point-to-point, every
  receiver's read loads its source's NIC; with ``broadcast``, the receivers (on other hosts than
  every copy) that need the same cell form one chain: the chosen source sends it once to the
  first, each relays it to the next, host by host, so each host is entered once (at its least
  loaded receiver) and the rest is relayed over NVLink. Each trainer host is thus the source of
  the cells its ranks hold, and the cells are balanced over every holder's links.

This module holds the planner's inputs and output and :func:`plan_topology`, which checks the
inputs and gathers what each receiver needs; the work is done in three modules beside it:
:mod:`weightsync.topology_model` (boxes, the link model, the predicted time and the floor),
:mod:`weightsync.topology_cells` (cutting needed boxes into cells; each cell's nearest copies)
and :mod:`weightsync.topology_assign` (the greedy balance over links; broadcast relay chains).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, NoReturn, Protocol

from weightsync.errors import ConfigError, PlanError
from weightsync.topology_assign import Chosen, Item, assign
from weightsync.topology_cells import Holder, Nearest, cells, nearest, split_rows
from weightsync.topology_model import (
    DEFAULT_RATES,
    ROUTES,
    Box,
    Demand,
    Fanout,
    Link,
    LinkRates,
    Route,
    busiest,
    fits,
    floor,
    merge_boxes,
    shard_box,
    whole_box,
)

DEFAULT_SPLIT_MIN_BYTES = 64 * 1024 * 1024

__all__ = [
    "DEFAULT_SPLIT_MIN_BYTES", "Box", "Link", "LinkRates", "Piece", "Receiver", "Route", "Source",
    "TensorLike", "TopologyPlan", "Transfer", "cells", "merge_boxes", "plan_topology",
    "shard_box", "whole_box",
]  # fmt: skip


class TensorLike(Protocol):
    """What the planner needs of a manifest entry; :class:`weightsync.buckets.TensorSpec` fits."""

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class Piece:
    """The box ``box`` of the HF tensor ``tensor``."""

    tensor: str
    box: Box


@dataclass(frozen=True)
class Source:
    """A trainer rank offering the pieces it holds, on GPU ``gpu`` (a device uuid) of ``host``."""

    rank: int
    gpu: str
    host: str
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Receiver:
    """An engine rank on ``gpu`` of ``host``. ``needs`` empty: every tensor whole; otherwise
    exactly the listed pieces (a tensor not listed is not needed, e.g. another PP stage's)."""

    id: str
    gpu: str
    host: str
    needs: tuple[Piece, ...] = ()


@dataclass(frozen=True)
class Transfer:
    """Receiver ``receiver`` copies ``box`` of ``tensor`` from source rank ``source``."""

    receiver: str
    tensor: str
    box: Box
    source: int
    route: Route
    nbytes: int
    via: str | None = None
    """None: straight from the source; else relayed by this receiver (a broadcast chain's
    previous hop), ``route`` then being the hop's own."""


@dataclass(frozen=True)
class TopologyPlan:
    _chosen: tuple[Chosen, ...] = field(repr=False)
    """Each cell (or row range), its source and its hops: the transfers, before joining."""
    route_bytes: dict[Route, int]
    """Bytes receivers take by route, every route listed (a relayed copy: its hop's route)."""
    link_bytes: dict[Link, int]
    """Bytes per link (see :mod:`weightsync.topology_model`), in link order."""
    receiver_bytes: dict[str, int]
    """Bytes each receiver takes (every receiver listed)."""
    source_bytes: dict[int, int]
    """Bytes each source rank sends itself (every source listed; relays not counted)."""
    predicted_s: float
    """The busiest link's bytes over its rate."""
    bottleneck: Link | None
    floor_s: float
    """The least any nearest-copy plan can take: :func:`weightsync.topology_model.floor`."""
    floor_bound: str
    """What bounds the floor, in words."""
    rates: LinkRates

    @cached_property
    def transfers(self) -> tuple[Transfer, ...]:
        """Ordered by receiver id, manifest order, box, source rank. Built on first use: a plan
        asked only for its times (``weightsync plan`` of a 1T model) need not list millions."""
        # Rejoin what the cutting and splitting left adjacent, per (receiver, tensor, source, via).
        groups: dict[tuple[str, int, str, int, Route, str | None, int], list[tuple[Box, int]]]
        groups = defaultdict(list)
        for it, h, hops in self._chosen:
            via: str | None = None
            for hop_route, _, rid in hops:
                groups[(rid, it.order, it.tensor, h.rank, hop_route, via, it.itemsize)].append(
                    (it.box, 0)
                )
                via = rid
        transfers = []
        for (rid, order, tensor, rank, route, via, itemsize), boxes in groups.items():
            for box, _ in merge_boxes(boxes):
                n = box.numel * itemsize
                transfers.append(
                    (rid, order, box, rank, Transfer(rid, tensor, box, rank, route, n, via))
                )
        transfers.sort(key=lambda t: t[:4])
        return tuple(t[-1] for t in transfers)


class _Spec(NamedTuple):
    order: int
    shape: tuple[int, ...]
    itemsize: int


# Per tensor: each distinct box sources hold, and its holders by rank (DP replicas share a box).
_Held = dict[Box, tuple[Holder, ...]]
_Cells = list[tuple[Box, tuple[Holder, ...]]]


def _check_box(what: str, name: str, box: Box, specs: dict[str, _Spec]) -> None:
    spec = specs.get(name)
    if spec is None:
        raise PlanError(f"{what} names tensor {name!r}, which is not in the manifest")
    if not fits(box.start, box.size, spec.shape):
        raise PlanError(f"{what}: box {box} of tensor {name!r} is outside its shape {spec.shape}")


def _validate(
    manifest: Sequence[TensorLike], sources: Sequence[Source], receivers: Sequence[Receiver]
) -> dict[str, _Spec]:
    specs: dict[str, _Spec] = {}
    for i, t in enumerate(manifest):
        if t.name in specs:
            raise PlanError(f"tensor {t.name!r} appears twice in the manifest")
        numel = math.prod(t.shape)
        specs[t.name] = _Spec(i, tuple(t.shape), t.nbytes // numel if numel else 0)
    for what, ids in (
        ("source rank", [s.rank for s in sources]),
        ("receiver id", [r.id for r in receivers]),
    ):
        dup = sorted((i for i, n in Counter(ids).items() if n > 1), key=str)
        if dup:
            raise PlanError(f"{what} {dup[0]!r} appears twice")
    host_of: dict[str, str] = {}
    for who in (*sources, *receivers):
        if host_of.setdefault(who.gpu, who.host) != who.host:
            raise PlanError(
                f"GPU {who.gpu!r} is said to be on hosts {host_of[who.gpu]!r} and "
                f"{who.host!r}; give each host a distinct id and each GPU its uuid"
            )
    checked: set[int] = set()  # DP copies share piece objects: check each once (by identity)
    for s in sources:
        for p in s.pieces:
            if id(p) not in checked:
                _check_box(f"source rank {s.rank}", p.tensor, p.box, specs)
                checked.add(id(p))
    needs_checked: set[int] = set()
    for r in receivers:
        if id(r.needs) in needs_checked:
            continue
        needs_checked.add(id(r.needs))
        by_tensor: dict[str, list[Piece]] = defaultdict(list)
        for p in r.needs:
            _check_box(f"receiver {r.id!r}", p.tensor, p.box, specs)
            by_tensor[p.tensor].append(p)
        pairs = (pair for ps in by_tensor.values() for pair in itertools.combinations(ps, 2))
        for a, b in pairs:
            if a.box.intersect(b.box) is not None:
                raise PlanError(
                    f"receiver {r.id!r} needs overlapping boxes {a.box} and {b.box} "
                    f"of tensor {a.tensor!r}; declare each element once"
                )
    return specs


def plan_topology(
    manifest: Sequence[TensorLike],
    sources: Sequence[Source],
    receivers: Sequence[Receiver],
    rates: LinkRates = DEFAULT_RATES,
    *,
    split_min_bytes: int = DEFAULT_SPLIT_MIN_BYTES,
    broadcast: bool = False,
) -> TopologyPlan:
    """Plan every receiver's needs from the nearest sources (see the module docstring).

    ``broadcast``: receivers that need the same cell from another host get it by one broadcast
    (a relay chain: the source sends once), else each reads it point-to-point.

    Guarantees: the transfers of each receiver cover exactly the boxes it needs, each element
    once; each comes from a nearest source holding all of it; the same inputs in any order give
    the same plan; ``floor_s <= predicted_s`` (up to float rounding).

    Raises:
        PlanError: a needed box (or part of it) is held by no source, naming the receiver, the
        tensor and the uncovered box; unknown tensors, boxes outside a tensor, duplicate ids,
        overlapping needs, a GPU placed on two hosts.
    """
    if split_min_bytes < 1:
        raise ConfigError(f"split_min_bytes={split_min_bytes} must be >= 1")
    specs = _validate(manifest, sources, receivers)
    # Holders per piece object first (DP copies share them, and hashing boxes is the cost).
    by_piece: dict[int, tuple[Piece, dict[Holder, None]]] = {}
    for s in sorted(sources, key=lambda s: s.rank):
        holder = Holder(s.rank, s.gpu, s.host)
        for p in s.pieces:
            if p.box.numel:
                by_piece.setdefault(id(p), (p, {}))[1][holder] = None
    holders_of: dict[str, dict[Box, dict[Holder, None]]] = defaultdict(lambda: defaultdict(dict))
    for p, hs in by_piece.values():
        holders_of[p.tensor][p.box].update(hs)
    held: dict[str, _Held] = {
        n: {b: tuple(sorted(hs)) for b, hs in by.items()} for n, by in holders_of.items()
    }
    everything = tuple(Piece(name, whole_box(s.shape)) for name, s in specs.items())
    # Engine ranks of one TP/EP rank in every replica share one needs tuple: walk it once (by
    # identity: hashing thousands of pieces per receiver would cost more than the walk).
    alike: dict[int, tuple[tuple[Piece, ...], list[Receiver]]] = {}
    for r in sorted(receivers, key=lambda r: r.id):
        alike.setdefault(id(r.needs), (r.needs, []))[1].append(r)
    near_of: dict[tuple[str, str, tuple[Holder, ...]], Nearest] = {}
    demand: dict[tuple[Route, tuple[str, str], frozenset[tuple[str, str]]], int] = defaultdict(int)
    chains: dict[tuple[str, Box, tuple[Holder, ...]], list[Receiver]] = defaultdict(list)
    items: list[Item] = []
    for needs, members in alike.values():
        for need in needs or everything:
            if not need.box.numel:
                continue
            spec = specs[need.tensor]
            for cell, holders in cells(need.box, held.get(need.tensor, {})):
                if not holders:
                    _uncovered(need, members[0], cells(need.box, held.get(need.tensor, {})), held)
                nbytes = cell.numel * spec.itemsize
                local_to: list[Receiver] = members
                if broadcast:
                    hosts = {h.host for h in holders}
                    local_to = [r for r in members if r.host in hosts]
                    if len(local_to) < len(members):
                        chains[(need.tensor, cell, holders)] += (
                            [r for r in members if r.host not in hosts] if local_to else members
                        )
                for r in local_to:
                    nk = (r.gpu, r.host, holders)
                    near = near_of.get(nk) or near_of.setdefault(nk, nearest(*nk))
                    demand[(near.route, (r.gpu, r.host), near.where)] += nbytes
                    # Peer reads are not split: a receiver reads a set of copies from one.
                    split = nbytes >= split_min_bytes and near.route != "peer"
                    for box in split_rows(cell, len(near.candidates) if split else 1):
                        n = box.numel * spec.itemsize
                        items.append(
                            Item(n, (r,), spec.order, need.tensor, box, spec.itemsize, near)
                        )
    fanout: dict[tuple[int, frozenset[tuple[str, str]]], int] = defaultdict(int)
    interned: dict[tuple[str, ...], tuple[Receiver, ...]] = {}  # equal chains: one tuple
    remote_near: dict[tuple[Holder, ...], Nearest] = {}
    for (tensor, cell, holders), rs in chains.items():
        spec = specs[tensor]
        if holders not in remote_near:  # remote: every holder, whoever receives
            remote_near[holders] = nearest(rs[0].gpu, rs[0].host, holders)
        near = remote_near[holders]
        nbytes = cell.numel * spec.itemsize
        chain = interned.setdefault(tuple(r.id for r in rs), tuple(rs))
        if len(rs) == 1:
            demand[("remote", (rs[0].gpu, rs[0].host), near.where)] += nbytes
        else:
            fanout[(id(chain), near.where)] += nbytes
        parts = len(near.candidates) if nbytes >= split_min_bytes else 1
        for box in split_rows(cell, parts):
            n = box.numel * spec.itemsize
            items.append(Item(n, chain, spec.order, tensor, box, spec.itemsize, near))
    demands = [Demand(route, dst, where, n) for (route, dst, where), n in demand.items()]
    by_chain = {id(c): c for c in interned.values()}
    fanouts = [
        Fanout(frozenset((r.gpu, r.host) for r in by_chain[c]), where, n)
        for (c, where), n in fanout.items()
    ]
    gpus_per_host = Counter(host for host, _ in {(r.host, r.gpu) for r in receivers})
    bound = floor(demands, rates, fanouts, dict(gpus_per_host))
    chosen, loads = assign(items, sources, receivers, rates)
    route_bytes = dict.fromkeys(ROUTES, 0)
    receiver_bytes = dict.fromkeys(sorted(r.id for r in receivers), 0)
    source_bytes = dict.fromkeys(sorted(s.rank for s in sources), 0)
    for it, h, hops in chosen:
        source_bytes[h.rank] += it.nbytes
        for hop_route, _, rid in hops:
            route_bytes[hop_route] += it.nbytes
            receiver_bytes[rid] += it.nbytes
    predicted, bottleneck = busiest(loads, rates)
    return TopologyPlan(
        _chosen=tuple(chosen),
        route_bytes=route_bytes,
        link_bytes={link: loads[link] for link in sorted(loads) if loads[link]},
        receiver_bytes=receiver_bytes,
        source_bytes=source_bytes,
        predicted_s=predicted,
        bottleneck=bottleneck,
        floor_s=bound.seconds,
        floor_bound=bound.bound,
        rates=rates,
    )


def _uncovered(need: Piece, r: Receiver, cells: _Cells, held: dict[str, _Held]) -> NoReturn:
    missing = ", ".join(str(c) for c, h in cells if not h)
    offered = sorted(str(b) for b in held.get(need.tensor, {}))
    raise PlanError(
        f"tensor {need.tensor!r}: box {missing} needed by receiver {r.id!r} is "
        f"held by no source (sources offer {offered[:8] or 'none of it'}"
        f"{' ...' if len(offered) > 8 else ''}); check the publisher's pieces"
    )
