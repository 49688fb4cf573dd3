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
  whose links would finish earliest (ties by GPU uuid, then rank). A cell of at least
  ``split_min_bytes`` with several equally near copies is cut into dim-0 row ranges first, so one
  large tensor can come from several GPUs at once.
- **Hosts and broadcast.** Cross-host bytes go over the GPUs' NICs. Point-to-point, every
  receiver's read loads its source's NIC; with ``broadcast``, the receivers (on other hosts than
  every copy) that need the same cell form one chain: the chosen source sends it once to the
  first, each relays it to the next, host by host, so each host is entered once (at its least
  loaded receiver) and the rest is relayed over NVLink. Each trainer host is thus the source of
  the cells its ranks hold, and the cells are balanced over every holder's links.

See :mod:`weightsync.topology_model` for the link model, the predicted time and the floor.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, NoReturn, Protocol, TypeVar

from weightsync.errors import ConfigError, PlanError
from weightsync.topology_model import (
    DEFAULT_RATES,
    ROUTES,
    Box,
    Demand,
    Fanout,
    Floor,
    Link,
    LinkKind,
    LinkRates,
    Route,
    busiest,
    fits,
    floor,
    merge_boxes,
    route_links,
    shard_box,
    source_links,
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
    _chosen: tuple[tuple[_Item, _Holder, list[_Hop]], ...] = field(repr=False)
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

    def link_seconds(self) -> dict[Link, float]:
        """Each link's bytes over its rate: the plan's time if that link alone were loaded."""
        return {link: n / self.rates.rate(link.kind) for link, n in self.link_bytes.items()}


class _Spec(NamedTuple):
    order: int
    shape: tuple[int, ...]
    itemsize: int


class _Holder(NamedTuple):
    rank: int
    gpu: str
    host: str


class _Nearest(NamedTuple):
    route: Route
    candidates: tuple[_Holder, ...]
    """One per GPU (its lowest rank), by GPU uuid."""
    where: frozenset[tuple[str, str]]
    """The candidates' ``(gpu, host)``."""


class _Item(NamedTuple):
    nbytes: int
    receivers: tuple[Receiver, ...]
    """One, or (a broadcast) every receiver that needs these same bytes from another host."""
    order: int
    tensor: str
    box: Box
    itemsize: int
    near: _Nearest


# Per tensor: each distinct box sources hold, and its holders by rank (DP replicas share a box).
_Held = dict[Box, tuple[_Holder, ...]]
_Cells = list[tuple[Box, tuple[_Holder, ...]]]
_H = TypeVar("_H")
"""A holder of a box: anything sortable (the planner's sort by rank)."""


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


def cells(need: Box, held: Mapping[Box, tuple[_H, ...]]) -> list[tuple[Box, tuple[_H, ...]]]:
    """``need`` cut where the held boxes begin and end, each cell with every holder of all of
    it (``held``'s holders come sorted; none where nothing covers it), cells of equal holders
    joined: what the planner reads, each cell from one holder."""
    near = [(b, hs) for b, hs in held.items() if b.overlaps(need)]
    if len(near) == 1 and near[0][0].contains(need):  # the common case: one box holds it all
        return [(need, near[0][1])]
    cuts = []
    for d, (lo, hi) in enumerate(zip(need.start, need.stop, strict=True)):
        points = {lo, hi} | {min(max(p, lo), hi) for b, _ in near for p in (b.start[d], b.stop[d])}
        cuts.append(sorted(points))
    out = []
    for spans in itertools.product(*(zip(c, c[1:], strict=False) for c in cuts)):
        cell = Box(tuple(a for a, _ in spans), tuple(b - a for a, b in spans))
        out.append((cell, tuple(sorted(h for b, hs in near if b.contains(cell) for h in hs))))
    return merge_boxes(out)


def _split(box: Box, parts: int) -> list[Box]:
    """``box`` as up to ``parts`` near-equal dim-0 row ranges."""
    if not box.size or parts <= 1 or box.size[0] <= 1:
        return [box]
    parts = min(parts, box.size[0])
    rows = [box.size[0] * i // parts for i in range(parts + 1)]
    return [
        Box((box.start[0] + a, *box.start[1:]), (b - a, *box.size[1:]))
        for a, b in zip(rows, rows[1:], strict=False)
    ]


def _nearest(r: Receiver, holders: tuple[_Holder, ...]) -> _Nearest:
    route: Route = "remote"
    near = list(holders)
    if any(h.gpu == r.gpu for h in holders):
        route, near = "local", [h for h in holders if h.gpu == r.gpu]
    elif any(h.host == r.host for h in holders):
        route, near = "peer", [h for h in holders if h.host == r.host]
    per_gpu: dict[str, _Holder] = {}
    for h in near:  # holders come by rank, so the first per GPU is its lowest rank
        per_gpu.setdefault(h.gpu, h)
    candidates = tuple(per_gpu[g] for g in sorted(per_gpu))
    return _Nearest(route, candidates, frozenset((h.gpu, h.host) for h in candidates))


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
    by_piece: dict[int, tuple[Piece, dict[_Holder, None]]] = {}
    for s in sorted(sources, key=lambda s: s.rank):
        holder = _Holder(s.rank, s.gpu, s.host)
        for p in s.pieces:
            if p.box.numel:
                by_piece.setdefault(id(p), (p, {}))[1][holder] = None
    holders_of: dict[str, dict[Box, dict[_Holder, None]]] = defaultdict(lambda: defaultdict(dict))
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
    nearest: dict[tuple[str, str, tuple[_Holder, ...]], _Nearest] = {}
    demand: dict[tuple[Route, tuple[str, str], frozenset[tuple[str, str]]], int] = defaultdict(int)
    chains: dict[tuple[str, Box, tuple[_Holder, ...]], list[Receiver]] = defaultdict(list)
    items: list[_Item] = []
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
                    near = nearest.get(nk) or nearest.setdefault(nk, _nearest(r, holders))
                    demand[(near.route, (r.gpu, r.host), near.where)] += nbytes
                    parts = len(near.candidates) if nbytes >= split_min_bytes else 1
                    for box in _split(cell, parts):
                        n = box.numel * spec.itemsize
                        items.append(
                            _Item(n, (r,), spec.order, need.tensor, box, spec.itemsize, near)
                        )
    fanout: dict[tuple[int, frozenset[tuple[str, str]]], int] = defaultdict(int)
    interned: dict[tuple[str, ...], tuple[Receiver, ...]] = {}  # equal chains: one tuple
    remote_near: dict[tuple[_Holder, ...], _Nearest] = {}
    for (tensor, cell, holders), rs in chains.items():
        spec = specs[tensor]
        if holders not in remote_near:  # remote: every holder, whoever receives
            remote_near[holders] = _nearest(rs[0], holders)
        near = remote_near[holders]
        nbytes = cell.numel * spec.itemsize
        chain = interned.setdefault(tuple(r.id for r in rs), tuple(rs))
        if len(rs) == 1:
            demand[("remote", (rs[0].gpu, rs[0].host), near.where)] += nbytes
        else:
            fanout[(id(chain), near.where)] += nbytes
        parts = len(near.candidates) if nbytes >= split_min_bytes else 1
        for box in _split(cell, parts):
            n = box.numel * spec.itemsize
            items.append(_Item(n, chain, spec.order, tensor, box, spec.itemsize, near))
    demands = [Demand(route, dst, where, n) for (route, dst, where), n in demand.items()]
    by_chain = {id(c): c for c in interned.values()}
    fanouts = [
        Fanout(frozenset((r.gpu, r.host) for r in by_chain[c]), where, n)
        for (c, where), n in fanout.items()
    ]
    gpus_per_host = Counter(host for host, _ in {(r.host, r.gpu) for r in receivers})
    bound = floor(demands, rates, fanouts, dict(gpus_per_host))
    return _assign(items, bound, sources, receivers, rates)


def _uncovered(need: Piece, r: Receiver, cells: _Cells, held: dict[str, _Held]) -> NoReturn:
    missing = ", ".join(str(c) for c, h in cells if not h)
    offered = sorted(str(b) for b in held.get(need.tensor, {}))
    raise PlanError(
        f"tensor {need.tensor!r}: box {missing} needed by receiver {r.id!r} is "
        f"held by no source (sources offer {offered[:8] or 'none of it'}"
        f"{' ...' if len(offered) > 8 else ''}); check the publisher's pieces"
    )


_Hop = tuple[Route, str, str]
"""A copy of a broadcast chain: (route, from GPU, to receiver id)."""


def _fixed_chain(receivers: tuple[Receiver, ...]) -> tuple[Receiver, ...]:
    """The relay order of receivers on distinct hosts (by host), else ()."""
    if len(receivers) == 1:
        return receivers
    hosts = [r.host for r in receivers]
    if len(set(hosts)) < len(hosts):
        return ()
    return tuple(sorted(receivers, key=lambda r: r.host))


def _hops(route: Route, src: _Holder, chain: Sequence[Receiver]) -> list[_Hop]:
    """``(route, from gpu, to receiver)`` of each hop: source -> chain[0] -> chain[1] ..."""
    hops: list[_Hop] = [(route, src.gpu, chain[0].id)]
    for a, b in itertools.pairwise(chain):
        hop: Route = "local" if a.gpu == b.gpu else "peer" if a.host == b.host else "remote"
        hops.append((hop, a.gpu, b.id))
    return hops


def _assign(
    items: list[_Item],
    bound: Floor,
    sources: Sequence[Source],
    receivers: Sequence[Receiver],
    rates: LinkRates,
) -> TopologyPlan:
    """Greedy balance: largest items first, each to the candidate that finishes earliest; a
    broadcast chain enters each host at its receiver whose inbound link is least loaded."""
    # Links by index and source choices cached: this loop runs once per cell and receiver.
    index: dict[Link, int] = {}
    load: list[int] = []
    rate: list[float] = []

    def ids(links: tuple[Link, ...]) -> tuple[int, ...]:
        for link in links:
            if link not in index:
                index[link] = len(load)
                load.append(0)
                rate.append(rates.rate(link.kind))
        return tuple(index[link] for link in links)

    gpu_host = {s.gpu: s.host for s in sources} | {r.gpu: r.host for r in receivers}
    by_id = {r.id: r for r in receivers}
    src_links: dict[tuple[Route, _Holder], tuple[int, ...]] = {}
    hop_links: dict[tuple[Route, str, str], tuple[int, ...]] = {}
    fixed_order: dict[int, tuple[Receiver, ...]] = {}  # by id: items share interned chains
    chain_links: dict[tuple[int, Route, _Holder], tuple[list[_Hop], tuple[int, ...]]] = {}

    def links_of(hop: _Hop) -> tuple[int, ...]:
        links = hop_links.get(hop)
        if links is None:
            r = by_id[hop[2]]
            src = (hop[1], gpu_host[hop[1]])
            links = hop_links[hop] = ids(route_links(hop[0], src, (r.gpu, r.host)))
        return links

    nics: dict[tuple[LinkKind, str], int] = {}

    def nic_of(kind: LinkKind, r: Receiver) -> int:
        i = nics.get((kind, r.gpu))
        if i is None:
            i = nics[(kind, r.gpu)] = ids((Link(kind, r.gpu),))[0]
        return i

    chosen: list[tuple[_Item, _Holder, list[tuple[Route, str, str]]]] = []
    items.sort(key=lambda it: (-it.nbytes, it.receivers[0].id, it.order, it.box))
    for it in items:
        route, cands, n = it.near.route, it.near.candidates, it.nbytes
        best = cands[0]
        if len(cands) > 1:
            finish = []
            for h in cands:
                if (route, h) not in src_links:
                    src_links[(route, h)] = ids(source_links(route, (h.gpu, h.host)))
                busy = max(((load[i] + n) / rate[i] for i in src_links[(route, h)]), default=0)
                finish.append((busy, h.gpu, h))
            best = min(finish)[2]
        fixed = fixed_order.get(id(it.receivers))
        if fixed is None:
            fixed = fixed_order[id(it.receivers)] = _fixed_chain(it.receivers)
        if fixed:  # no host takes two: the order does not depend on the loads
            key = (id(it.receivers), route, best)
            if key not in chain_links:
                hops = _hops(route, best, fixed)
                chain_links[key] = (hops, tuple(i for hop in hops for i in links_of(hop)))
            hops, links = chain_links[key]
        else:
            chain = _chain(
                it.receivers,
                lambda r: load[nic_of("nic_in", r)],
                lambda r: load[nic_of("nic_out", r)],
            )
            hops = _hops(route, best, chain)
            links = tuple(i for hop in hops for i in links_of(hop))
        for i in links:
            load[i] += n
        chosen.append((it, best, hops))
    route_bytes = dict.fromkeys(ROUTES, 0)
    receiver_bytes = dict.fromkeys(sorted(r.id for r in receivers), 0)
    source_bytes = dict.fromkeys(sorted(s.rank for s in sources), 0)
    for it, h, hops in chosen:
        source_bytes[h.rank] += it.nbytes
        for hop_route, _, rid in hops:
            route_bytes[hop_route] += it.nbytes
            receiver_bytes[rid] += it.nbytes
    predicted, bottleneck = busiest({link: load[i] for link, i in index.items()}, rates)
    return TopologyPlan(
        _chosen=tuple(chosen),
        route_bytes=route_bytes,
        link_bytes={link: load[index[link]] for link in sorted(index) if load[index[link]]},
        receiver_bytes=receiver_bytes,
        source_bytes=source_bytes,
        predicted_s=predicted,
        bottleneck=bottleneck,
        floor_s=bound.seconds,
        floor_bound=bound.bound,
        rates=rates,
    )


def _chain(
    receivers: Sequence[Receiver],
    inbound: Callable[[Receiver], int],
    outbound: Callable[[Receiver], int],
) -> list[Receiver]:
    """A broadcast's relay order: host by host (so each host is entered once and the rest is
    relayed over NVLink), entering each host at its receiver with the least inbound load and
    leaving it from the other one with the least outbound load."""
    by_host: dict[str, list[Receiver]] = defaultdict(list)
    for r in receivers:
        by_host[r.host].append(r)
    chain: list[Receiver] = []
    for host in sorted(by_host):
        rs = by_host[host]
        entry = min(rs, key=lambda r: (inbound(r), r.id))
        rest = [r for r in rs if r is not entry]
        if rest:
            exit_ = min(rest, key=lambda r: (outbound(r), r.id))
            rest = [r for r in rest if r is not exit_] + [exit_]
        chain += [entry, *rest]
    return chain
