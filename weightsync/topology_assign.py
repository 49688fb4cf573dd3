"""Assignment, for the topology planner: which copy sends each cell, and a broadcast's relays.

Greedy balance over the links of :mod:`weightsync.topology_model`: largest items first, each to
the equally near candidate whose links would finish earliest (ties by GPU uuid, then rank).
Peer reads are balanced per receiver and set of copies instead (:func:`_peer_sources`): a
receiver takes everything it reads from one set of equally near copies on another GPU of its
host from one of them, so GPUs pair up. Copy engines move a GPU's peer bytes fastest between
pairs and slow down when one GPU reads from (or serves) several peers at once: on 4 x H200,
386 GB/s into each GPU for pairs, 229 GB/s when each read from three (docs/benchmarks.md). A
broadcast item (one cell for several receivers on other hosts) becomes a relay chain, host by
host, entering each host at its receiver whose inbound link is least loaded.

Pure code; :mod:`weightsync.topology` builds the items and turns the result into a plan.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from weightsync.topology_cells import Holder, Nearest
from weightsync.topology_model import (
    Box,
    Link,
    LinkKind,
    LinkRates,
    Route,
    route_links,
    source_links,
)

if TYPE_CHECKING:
    from weightsync.topology import Receiver, Source


class Item(NamedTuple):
    """A cell (or a row range of one) some receivers need: what the balance assigns."""

    nbytes: int
    receivers: tuple[Receiver, ...]
    """One, or (a broadcast) every receiver that needs these same bytes from another host."""
    order: int
    tensor: str
    box: Box
    itemsize: int
    near: Nearest


Hop = tuple[Route, str, str]
"""A copy of a broadcast chain: (route, from GPU, to receiver id)."""

Chosen = tuple[Item, Holder, list[Hop]]
"""An item, the source that sends it and its hops."""


def assign(
    items: list[Item],
    sources: Sequence[Source],
    receivers: Sequence[Receiver],
    rates: LinkRates,
) -> tuple[list[Chosen], dict[Link, int]]:
    """Each item's source and hops (``items`` sorted in place, largest first), and the bytes
    each link then carries, in the order the links were first loaded."""
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
    src_links: dict[tuple[Route, Holder], tuple[int, ...]] = {}
    hop_links: dict[tuple[Route, str, str], tuple[int, ...]] = {}
    fixed_order: dict[int, tuple[Receiver, ...]] = {}  # by id: items share interned chains
    chain_links: dict[tuple[int, Route, Holder], tuple[list[Hop], tuple[int, ...]]] = {}

    def links_of(hop: Hop) -> tuple[int, ...]:
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

    chosen: list[Chosen] = []
    items.sort(key=lambda it: (-it.nbytes, it.receivers[0].id, it.order, it.box))
    paired = _peer_sources(items)
    for it in items:
        route, cands, n = it.near.route, it.near.candidates, it.nbytes
        best = cands[0]
        if len(cands) > 1 and route == "peer":
            best = paired[(it.receivers[0].id, cands)]
        elif len(cands) > 1:
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
            order = _chain(
                it.receivers,
                lambda r: load[nic_of("nic_in", r)],
                lambda r: load[nic_of("nic_out", r)],
            )
            hops = _hops(route, best, order)
            links = tuple(i for hop in hops for i in links_of(hop))
        for i in links:
            load[i] += n
        chosen.append((it, best, hops))
    return chosen, {link: load[i] for link, i in index.items()}


def _peer_sources(items: Sequence[Item]) -> dict[tuple[str, tuple[Holder, ...]], Holder]:
    """The one source each receiver reads each set of equally near peer copies from: the
    receivers' sets, largest first, each to the copy whose GPU would then send the fewest peer
    bytes (one NVLink rate for all: the earliest to finish), counting the reads that have one
    copy to choose from first; ties by GPU uuid, then rank."""
    out_load: Counter[str] = Counter()
    groups: Counter[tuple[str, tuple[Holder, ...]]] = Counter()
    for it in items:
        if it.near.route != "peer":
            continue
        cands = it.near.candidates
        if len(cands) == 1:
            out_load[cands[0].gpu] += it.nbytes
        else:
            groups[(it.receivers[0].id, cands)] += it.nbytes
    chosen: dict[tuple[str, tuple[Holder, ...]], Holder] = {}
    for key, n in sorted(groups.items(), key=lambda kv: (-kv[1], kv[0])):
        best = min(key[1], key=lambda h: (out_load[h.gpu], h.gpu, h))
        out_load[best.gpu] += n
        chosen[key] = best
    return chosen


def _fixed_chain(receivers: tuple[Receiver, ...]) -> tuple[Receiver, ...]:
    """The relay order of receivers on distinct hosts (by host), else ()."""
    if len(receivers) == 1:
        return receivers
    hosts = [r.host for r in receivers]
    if len(set(hosts)) < len(hosts):
        return ()
    return tuple(sorted(receivers, key=lambda r: r.host))


def _hops(route: Route, src: Holder, chain: Sequence[Receiver]) -> list[Hop]:
    """``(route, from gpu, to receiver)`` of each hop: source -> chain[0] -> chain[1] ..."""
    hops: list[Hop] = [(route, src.gpu, chain[0].id)]
    for a, b in itertools.pairwise(chain):
        hop: Route = "local" if a.gpu == b.gpu else "peer" if a.host == b.host else "remote"
        hops.append((hop, a.gpu, b.id))
    return hops


def _chain(
    receivers: Sequence[Receiver],
    inbound: Callable[[Receiver], int],
    outbound: Callable[[Receiver], int],
) -> list[Receiver]:
    """A broadcast's relay order: host by host (so each host is entered once and the rest is
    relayed over NVLink), entering each host at its receiver with the least inbound load and
    leaving it from the other one with the least outbound load."""
    by_host: dict[str, list[Receiver]] = {}
    for r in receivers:
        by_host.setdefault(r.host, []).append(r)
    order: list[Receiver] = []
    for host in sorted(by_host):
        rs = by_host[host]
        entry = min(rs, key=lambda r: (inbound(r), r.id))
        rest = [r for r in rs if r is not entry]
        if rest:
            exit_ = min(rest, key=lambda r: (outbound(r), r.id))
            rest = [r for r in rest if r is not exit_] + [exit_]
        order += [entry, *rest]
    return order
