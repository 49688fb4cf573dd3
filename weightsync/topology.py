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

See :mod:`weightsync.topology_model` for the link model, the predicted time and the floor.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from weightsync.errors import ConfigError, PlanError
from weightsync.topology_model import (
    DEFAULT_RATES,
    ROUTES,
    Box,
    Demand,
    Link,
    LinkRates,
    Route,
    busiest,
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
    "TensorLike", "TopologyPlan", "Transfer", "merge_boxes", "plan_topology", "shard_box",
    "whole_box",
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


@dataclass(frozen=True)
class TopologyPlan:
    transfers: tuple[Transfer, ...]
    """Ordered by receiver id, manifest order, box, source rank."""
    route_bytes: dict[Route, int]
    """Bytes per route, every route listed."""
    link_bytes: dict[Link, int]
    """Bytes per link (see :mod:`weightsync.topology_model`), in link order."""
    receiver_bytes: dict[str, int]
    """Bytes each receiver takes (every receiver listed)."""
    source_bytes: dict[int, int]
    """Bytes each source rank gives (every source listed)."""
    predicted_s: float
    """The busiest link's bytes over its rate."""
    bottleneck: Link | None
    floor_s: float
    """The least any nearest-copy plan can take: :func:`weightsync.topology_model.floor`."""
    floor_bound: str
    """What bounds the floor, in words."""
    rates: LinkRates

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
    receiver: Receiver
    order: int
    tensor: str
    box: Box
    itemsize: int
    near: _Nearest


# Per tensor: each distinct box sources hold, and its holders by rank (DP replicas share a box).
_Held = dict[Box, tuple[_Holder, ...]]
_Cells = list[tuple[Box, tuple[_Holder, ...]]]


def _check_box(what: str, name: str, box: Box, specs: dict[str, _Spec]) -> None:
    spec = specs.get(name)
    if spec is None:
        raise PlanError(f"{what} names tensor {name!r}, which is not in the manifest")
    shape = spec.shape
    if len(box.start) != len(shape) or any(b > s for b, s in zip(box.stop, shape, strict=True)):
        raise PlanError(f"{what}: box {box} of tensor {name!r} is outside its shape {shape}")


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
    for s in sources:
        for p in s.pieces:
            _check_box(f"source rank {s.rank}", p.tensor, p.box, specs)
    for r in receivers:
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


def _cells(need: Box, held: _Held) -> _Cells:
    """``need`` cut where the held boxes begin and end, each cell with every holder of all of
    it (none where nothing covers it), cells of equal holders joined."""
    near = [(b, hs) for b, hs in held.items() if b.overlaps(need)]
    cuts = []
    for d, (lo, hi) in enumerate(zip(need.start, need.stop, strict=True)):
        points = {lo, hi} | {min(max(p, lo), hi) for b, _ in near for p in (b.start[d], b.stop[d])}
        cuts.append(sorted(points))
    cells = []
    for spans in itertools.product(*(zip(c, c[1:], strict=False) for c in cuts)):
        cell = Box(tuple(a for a, _ in spans), tuple(b - a for a, b in spans))
        cells.append((cell, tuple(sorted(h for b, hs in near if b.contains(cell) for h in hs))))
    return merge_boxes(cells)


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
) -> TopologyPlan:
    """Plan every receiver's needs from the nearest sources (see the module docstring).

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
    holders_of: dict[str, dict[Box, list[_Holder]]] = defaultdict(lambda: defaultdict(list))
    for s in sorted(sources, key=lambda s: s.rank):
        for p in s.pieces:
            if p.box.numel and _Holder(s.rank, s.gpu, s.host) not in holders_of[p.tensor][p.box]:
                holders_of[p.tensor][p.box].append(_Holder(s.rank, s.gpu, s.host))
    held: dict[str, _Held] = {
        n: {b: tuple(hs) for b, hs in by.items()} for n, by in holders_of.items()
    }
    everything = tuple(Piece(name, whole_box(s.shape)) for name, s in specs.items())
    cells_of: dict[tuple[str, Box], _Cells] = {}  # engine ranks of one TP rank need equal boxes
    nearest: dict[tuple[str, str, tuple[_Holder, ...]], _Nearest] = {}
    demand: dict[tuple[Route, tuple[str, str], frozenset[tuple[str, str]]], int] = defaultdict(int)
    items: list[_Item] = []
    for r in sorted(receivers, key=lambda r: r.id):
        for need in r.needs or everything:
            if not need.box.numel:
                continue
            spec = specs[need.tensor]
            key = (need.tensor, need.box)
            if key not in cells_of:
                cells_of[key] = _cells(need.box, held.get(need.tensor, {}))
            for cell, holders in cells_of[key]:
                if not holders:
                    missing = ", ".join(str(c) for c, h in cells_of[key] if not h)
                    offered = sorted(str(b) for b in held.get(need.tensor, {}))
                    raise PlanError(
                        f"tensor {need.tensor!r}: box {missing} needed by receiver {r.id!r} is "
                        f"held by no source (sources offer {offered[:8] or 'none of it'}"
                        f"{' ...' if len(offered) > 8 else ''}); check the publisher's pieces"
                    )
                nk = (r.gpu, r.host, holders)
                near = nearest.get(nk) or nearest.setdefault(nk, _nearest(r, holders))
                nbytes = cell.numel * spec.itemsize
                demand[(near.route, (r.gpu, r.host), near.where)] += nbytes
                parts = len(near.candidates) if nbytes >= split_min_bytes else 1
                for box in _split(cell, parts):
                    n = box.numel * spec.itemsize
                    items.append(_Item(n, r, spec.order, need.tensor, box, spec.itemsize, near))
    demands = [Demand(route, dst, where, n) for (route, dst, where), n in demand.items()]
    return _assign(items, demands, sources, receivers, rates)


def _assign(
    items: list[_Item],
    demands: list[Demand],
    sources: Sequence[Source],
    receivers: Sequence[Receiver],
    rates: LinkRates,
) -> TopologyPlan:
    """Greedy balance: largest items first, each to the candidate that finishes earliest."""
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

    src_links: dict[tuple[Route, _Holder], tuple[int, ...]] = {}
    all_links: dict[tuple[Route, _Holder, str, str], tuple[int, ...]] = {}
    chosen: list[tuple[_Item, _Holder]] = []
    items.sort(key=lambda it: (-it.nbytes, it.receiver.id, it.order, it.box))
    for it in items:
        route, cands, r, n = it.near.route, it.near.candidates, it.receiver, it.nbytes
        best = cands[0]
        if len(cands) > 1:
            finish = []
            for h in cands:
                if (route, h) not in src_links:
                    src_links[(route, h)] = ids(source_links(route, (h.gpu, h.host)))
                busy = max(((load[i] + n) / rate[i] for i in src_links[(route, h)]), default=0)
                finish.append((busy, h.gpu, h))
            best = min(finish)[2]
        key = (route, best, r.gpu, r.host)
        if key not in all_links:
            all_links[key] = ids(route_links(route, (best.gpu, best.host), (r.gpu, r.host)))
        for i in all_links[key]:
            load[i] += n
        chosen.append((it, best))
    # Rejoin what the cutting and splitting left adjacent, per (receiver, tensor, source).
    groups: dict[tuple[str, int, str, int, Route, int], list[tuple[Box, int]]]
    groups = defaultdict(list)
    for it, h in chosen:
        key2 = (it.receiver.id, it.order, it.tensor, h.rank, it.near.route, it.itemsize)
        groups[key2].append((it.box, 0))
    transfers = []
    for (rid, _, tensor, rank, route, itemsize), boxes in groups.items():
        for box, _ in merge_boxes(boxes):
            transfers.append(Transfer(rid, tensor, box, rank, route, box.numel * itemsize))
    order = {it.tensor: it.order for it in items}
    transfers.sort(key=lambda t: (t.receiver, order[t.tensor], t.box, t.source))
    route_bytes = dict.fromkeys(ROUTES, 0)
    receiver_bytes = dict.fromkeys(sorted(r.id for r in receivers), 0)
    source_bytes = dict.fromkeys(sorted(s.rank for s in sources), 0)
    for t in transfers:
        route_bytes[t.route] += t.nbytes
        receiver_bytes[t.receiver] += t.nbytes
        source_bytes[t.source] += t.nbytes
    predicted, bottleneck = busiest({link: load[i] for link, i in index.items()}, rates)
    bound = floor(demands, rates)
    return TopologyPlan(
        transfers=tuple(transfers),
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
