"""Cutting, for the topology planner: needed boxes into cells, and each cell's nearest copies.

A needed box is cut where the sources' boxes begin and end (:func:`cells`), so every cell is held
whole by a fixed set of sources. Of those holders, :func:`nearest` keeps the nearest (same GPU >
same host > another host), one per GPU; a large cell with several such copies is cut again into
dim-0 row ranges (:func:`split_rows`), so one large tensor can come from several GPUs at once.

Pure code on :class:`~weightsync.topology_model.Box`; :mod:`weightsync.topology` runs it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import NamedTuple, TypeVar

from weightsync.topology_model import Box, Route, merge_boxes

_H = TypeVar("_H")
"""A holder of a box: anything sortable (the planner's sort by rank)."""


class Holder(NamedTuple):
    """A source rank holding a box, on GPU ``gpu`` (a device uuid) of ``host``."""

    rank: int
    gpu: str
    host: str


class Nearest(NamedTuple):
    """A receiver's nearest copies of a cell."""

    route: Route
    candidates: tuple[Holder, ...]
    """One per GPU (its lowest rank), by GPU uuid."""
    where: frozenset[tuple[str, str]]
    """The candidates' ``(gpu, host)``."""


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


def split_rows(box: Box, parts: int) -> list[Box]:
    """``box`` as up to ``parts`` near-equal dim-0 row ranges."""
    if not box.size or parts <= 1 or box.size[0] <= 1:
        return [box]
    parts = min(parts, box.size[0])
    rows = [box.size[0] * i // parts for i in range(parts + 1)]
    return [
        Box((box.start[0] + a, *box.start[1:]), (b - a, *box.size[1:]))
        for a, b in zip(rows, rows[1:], strict=False)
    ]


def nearest(gpu: str, host: str, holders: tuple[Holder, ...]) -> Nearest:
    """The nearest of ``holders`` to a receiver on ``gpu`` of ``host``: those on its GPU
    (``local``), else on its host (``peer``), else all (``remote``)."""
    route: Route = "remote"
    near = list(holders)
    if any(h.gpu == gpu for h in holders):
        route, near = "local", [h for h in holders if h.gpu == gpu]
    elif any(h.host == host for h in holders):
        route, near = "peer", [h for h in holders if h.host == host]
    per_gpu: dict[str, Holder] = {}
    for h in near:  # holders come by rank, so the first per GPU is its lowest rank
        per_gpu.setdefault(h.gpu, h)
    candidates = tuple(per_gpu[g] for g in sorted(per_gpu))
    return Nearest(route, candidates, frozenset((h.gpu, h.host) for h in candidates))
