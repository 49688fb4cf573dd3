"""The topology planner's model: boxes of tensors, links and their rates, and the floor.

Pure arithmetic on shapes, byte counts and ids; :mod:`weightsync.topology` builds plans on it
(and re-exports what callers need).

Boxes. A :class:`Box` is a rectangular block of a tensor's elements (start and size per dim);
sources hold boxes, receivers need boxes, transfers copy boxes.

The link model. Every link moves bytes at a fixed rate and all links run at once, so a plan takes
as long as its busiest link (its bytes over its rate). The links:

- ``hbm:<gpu>``: copies inside one GPU (a receiver reading a source on its own GPU); the rate is
  an effective copy rate (bytes copied per second, read and write together).
- ``nvlink_out:<gpu>`` / ``nvlink_in:<gpu>``: peer copies between GPUs of one host, per GPU and
  direction.
- ``nic_out:<gpu>`` / ``nic_in:<gpu>``: copies between hosts, through the GPU's own NIC (the
  rail-optimised layout of H100/H200 nodes, one NIC per GPU).
- ``host_out:<host>`` / ``host_in:<host>``: all of a host's cross-host bytes together; unbounded
  unless a per-host NIC rate is given (bytes are reported either way).

Fan-out. Point-to-point, every receiver's read counts on its source's links. A broadcast serves
several receivers needing the same bytes with one send: the planner chains them (source -> first
receiver -> next ...), each hop loading its own links, as NCCL's pipelined ring broadcast does, so
the source sends once and receivers relay (see :class:`Fanout` for its floor).

Not modelled: HBM traffic that peer and remote copies also cause, PCIe, latency (a pipelined
chain is taken to run at its slowest link's rate).
"""

from __future__ import annotations

import functools
import math
import operator
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from weightsync.errors import ConfigError, PlanError

Route = Literal["local", "peer", "remote"]
ROUTES: tuple[Route, ...] = ("local", "peer", "remote")
LinkKind = Literal["hbm", "nvlink_out", "nvlink_in", "nic_out", "nic_in", "host_out", "host_in"]


@dataclass(frozen=True, order=True)
class Box:
    """The elements ``start[d] <= i < start[d] + size[d]`` of every dim d of a tensor."""

    start: tuple[int, ...]
    size: tuple[int, ...]
    # Derived once: plans of large models test and hash boxes millions of times.
    stop: tuple[int, ...] = field(init=False, repr=False, compare=False)
    numel: int = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.start) != len(self.size) or min(self.start + self.size, default=0) < 0:
            raise PlanError(f"box start={self.start} size={self.size}: need equal lengths, >= 0")
        object.__setattr__(self, "stop", tuple(map(operator.add, self.start, self.size)))
        object.__setattr__(self, "numel", math.prod(self.size))
        object.__setattr__(self, "_hash", hash((self.start, self.size)))

    def __hash__(self) -> int:
        return self._hash

    def overlaps(self, other: Box) -> bool:
        """Whether they share an element (boxes of one tensor: equal ranks)."""
        return all(
            map(operator.lt, map(max, self.start, other.start), map(min, self.stop, other.stop))
        )

    def intersect(self, other: Box) -> Box | None:
        """The common box, or None when they share no element."""
        if not self.overlaps(other):
            return None
        lo = tuple(map(max, self.start, other.start))
        return Box(lo, tuple(map(operator.sub, map(min, self.stop, other.stop), lo)))

    def contains(self, other: Box) -> bool:
        return all(map(operator.le, self.start, other.start)) and all(
            map(operator.le, other.stop, self.stop)
        )

    def __str__(self) -> str:
        return "[" + ", ".join(f"{a}:{b}" for a, b in zip(self.start, self.stop, strict=True)) + "]"


def fits(start: Sequence[int], size: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether ``start`` and ``size`` (from anywhere: any lengths, any signs) are a box of a
    tensor of ``shape``."""
    return len(start) == len(size) == len(shape) and all(
        0 <= a and 0 <= n and a + n <= d for a, n, d in zip(start, size, shape, strict=True)
    )


Keeps = Mapping[str, Mapping[str, Box]]
"""By receiver id: the boxes it declared it keeps of tensors it keeps only part of."""


def whole_box(shape: Sequence[int]) -> Box:
    """The box of a whole tensor of ``shape`` (one object per shape: a trillion-parameter
    plan asks for the same few thousand hundreds of thousands of times)."""
    return _whole_box(tuple(shape))


@functools.lru_cache(maxsize=1 << 16)
def _whole_box(shape: tuple[int, ...]) -> Box:
    return Box((0,) * len(shape), shape)


def shard_box(shape: Sequence[int], dim: int, rank: int, world: int) -> Box:
    """The box TP rank ``rank`` of ``world`` keeps of a tensor split along ``dim`` (0 for a
    column-parallel weight, 1 for a row-parallel one). Shards are ``ceil(shape[dim] / world)``
    long and the last ones are clipped (possibly empty), as for a padded vocabulary."""
    if not 0 <= dim < len(shape) or not 0 <= rank < world:
        raise ConfigError(f"shard_box: dim={dim} rank={rank} world={world} for shape {shape}")
    per = -(-shape[dim] // world)
    lo = min(rank * per, shape[dim])
    hi = min(lo + per, shape[dim])
    start = tuple(lo if d == dim else 0 for d in range(len(shape)))
    size = tuple(hi - lo if d == dim else n for d, n in enumerate(shape))
    return Box(start, size)


K = TypeVar("K", bound=Hashable)


def merge_boxes(boxes: Sequence[tuple[Box, K]]) -> list[tuple[Box, K]]:
    """Join boxes with equal keys that touch along one dim and agree on every other one, dim by
    dim from the last. Same elements, same keys, fewer boxes; sorted by box."""
    out = list(boxes)
    if len(out) < 2:
        return out
    ndim = len(out[0][0].start)
    for d in reversed(range(ndim)):
        # Boxes that may join along d: same key, same extent in every other dim.
        groups: dict[tuple[K, tuple[int, ...], tuple[int, ...]], list[Box]] = defaultdict(list)
        for box, key in out:
            rest = (box.start[:d] + box.start[d + 1 :], box.size[:d] + box.size[d + 1 :])
            groups[(key, *rest)].append(box)
        out = []
        for (key, _, _), group in groups.items():
            group.sort()
            run = group[0]
            for box in group[1:]:
                if box.start[d] == run.stop[d]:
                    size = run.size[:d] + (run.size[d] + box.size[d],) + run.size[d + 1 :]
                    run = Box(run.start, size)
                else:
                    out.append((run, key))
                    run = box
            out.append((run, key))
    return sorted(out, key=lambda t: t[0])


@dataclass(frozen=True, order=True)
class Link:
    """One link of the model: its kind and where it is (a GPU uuid, or a host id for host_*)."""

    kind: LinkKind
    where: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.where}"


@dataclass(frozen=True)
class LinkRates:
    """Link rates in bytes per second. Defaults are H200-class measurements: one GPU copying
    15.2 GB in its own memory in 7.2 ms (2.1e12), peer reads over NVLink at about 3.4e11 per
    direction (4x H200, full mesh), and a 400 Gb/s NIC per GPU (5e10)."""

    hbm: float = 2.0e12
    nvlink_out: float = 3.5e11
    nvlink_in: float = 3.5e11
    nic_out: float = 5.0e10
    nic_in: float = 5.0e10
    host_out: float | None = None
    """All of a host's NICs together; None: only the per-GPU NICs bound it."""
    host_in: float | None = None

    def __post_init__(self) -> None:
        for kind in ("hbm", "nvlink_out", "nvlink_in", "nic_out", "nic_in", "host_out", "host_in"):
            value = getattr(self, kind)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"link rate {kind}={value!r} must be a positive finite number")

    def rate(self, kind: LinkKind) -> float:
        """Bytes per second of a link of ``kind``; ``inf`` for an unbounded host link."""
        value: float | None = getattr(self, kind)
        return math.inf if value is None else value


DEFAULT_RATES = LinkRates()


def route_links(route: Route, src: tuple[str, str], dst: tuple[str, str]) -> tuple[Link, ...]:
    """Every link a copy by ``route`` from ``src`` to ``dst`` (each ``(gpu, host)``) loads."""
    return source_links(route, src) + receiver_links(route, dst)


def source_links(route: Route, src: tuple[str, str]) -> tuple[Link, ...]:
    """The links that depend on which source is chosen (a local copy loads only its GPU's
    ``hbm``, which :func:`receiver_links` counts)."""
    if route == "local":
        return ()
    if route == "peer":
        return (Link("nvlink_out", src[0]),)
    return (Link("nic_out", src[0]), Link("host_out", src[1]))


def receiver_links(route: Route, dst: tuple[str, str]) -> tuple[Link, ...]:
    """The receiver's links: the same whichever source is chosen."""
    if route == "local":
        return (Link("hbm", dst[0]),)
    if route == "peer":
        return (Link("nvlink_in", dst[0]),)
    return (Link("nic_in", dst[0]), Link("host_in", dst[1]))


def busiest(load: dict[Link, int], rates: LinkRates) -> tuple[float, Link | None]:
    """The predicted time of a plan with these link bytes, and the link that bounds it (the
    smallest such link on ties; None when nothing moves)."""
    best: tuple[float, Link | None] = (0.0, None)
    for link in sorted(load):
        seconds = load[link] / rates.rate(link.kind)
        if seconds > best[0]:
            best = (seconds, link)
    return best


@dataclass(frozen=True)
class Demand:
    """Bytes that one receiver must take by ``route`` from any one of ``candidates`` (the
    ``(gpu, host)`` of every nearest source holding them)."""

    route: Route
    receiver: tuple[str, str]
    candidates: frozenset[tuple[str, str]]
    nbytes: int


@dataclass(frozen=True)
class Fanout:
    """Bytes that every receiver in ``receivers`` (each ``(gpu, host)``) needs, the same bytes,
    from any one of ``candidates`` on other hosts: one broadcast can serve them all."""

    receivers: frozenset[tuple[str, str]]
    candidates: frozenset[tuple[str, str]]
    nbytes: int


@dataclass(frozen=True)
class Floor:
    seconds: float
    bound: str
    """What bounds it, e.g. ``"nvlink_out of [GPU-0]: 4096 bytes only they send"``."""


def floor(
    demands: Iterable[Demand],
    rates: LinkRates,
    fanouts: Iterable[Fanout] = (),
    receiver_gpus: dict[str, int] | None = None,
) -> Floor:
    """The least time any plan that reads every byte from its nearest copy can take, in this
    link model, even if boxes could be split freely among equally near sources.

    It is the largest of these bounds, each one a link (or a set of links) that must carry bytes
    whatever the choice among equally near sources:

    1. receiver side, per link: for every receiver GPU, its local bytes over ``hbm`` (every GPU
       copying its own share at once), its peer bytes over ``nvlink_in``, its remote bytes over
       ``nic_in``; per receiver host, its remote bytes over ``host_in``;
    2. source side, per set S of GPUs that occurs as the candidates of some demand (and the
       union of all of them): the peer bytes whose candidates all lie in S over S's combined
       ``nvlink_out``; the same for remote bytes over ``nic_out``; and per set of hosts, remote
       bytes over the hosts' ``host_out``.

    The plan's own link bytes meet every bound, so ``floor <= predicted`` (up to float
    rounding); the gap is what whole boxes and greedy balance cost. Local bytes count only on
    the receiver's ``hbm`` (the same GPU's), so DP copies on every GPU give the "every GPU
    copies its own share at once" floor of the node issue.

    ``fanouts`` (broadcast bytes) may be relayed between receivers, so they count once: per
    receiver host, the fanned-out bytes any of its receivers needs must enter the host once,
    over its ``receiver_gpus[host]`` NICs (or ``host_in``); per candidate set, they must leave
    it once (the source-side bounds above, counting each fan-out once).
    """
    receiver_side: dict[Link, int] = defaultdict(int)
    # kind -> candidate set -> bytes that only that set can send.
    sets: dict[LinkKind, dict[frozenset[str], int]] = {
        "nvlink_out": defaultdict(int),
        "nic_out": defaultdict(int),
        "host_out": defaultdict(int),
    }
    for d in demands:
        for link in receiver_links(d.route, d.receiver):
            receiver_side[link] += d.nbytes
        if d.route == "peer":
            sets["nvlink_out"][frozenset(gpu for gpu, _ in d.candidates)] += d.nbytes
        elif d.route == "remote":
            sets["nic_out"][frozenset(gpu for gpu, _ in d.candidates)] += d.nbytes
            sets["host_out"][frozenset(host for _, host in d.candidates)] += d.nbytes
    host_once: dict[str, int] = defaultdict(int)
    for f in fanouts:
        for host in {h for _, h in f.receivers}:
            host_once[host] += f.nbytes
        sets["nic_out"][frozenset(gpu for gpu, _ in f.candidates)] += f.nbytes
        sets["host_out"][frozenset(host for _, host in f.candidates)] += f.nbytes
    terms: list[tuple[float, str]] = [(0.0, "nothing to move")]
    for link in sorted(receiver_side):
        n = receiver_side[link]
        terms.append((n / rates.rate(link.kind), f"{link} must carry {n} bytes"))
    gpus = receiver_gpus or {}
    for host in sorted(host_once):
        n = host_once[host]
        rate = min(gpus.get(host, 1) * rates.nic_in, rates.rate("host_in"))
        terms.append((n / rate, f"host {host} must take in {n} bytes over its NICs"))
    for kind, by_set in sets.items():
        if not by_set:
            continue
        cuts = set(by_set) | {frozenset().union(*by_set)}
        for cut in sorted(cuts, key=sorted):
            n = sum(v for s, v in by_set.items() if s <= cut)
            where = ", ".join(sorted(cut))
            terms.append(
                (
                    n / (len(cut) * rates.rate(kind)),
                    f"{kind} of [{where}]: {n} bytes only they send",
                )
            )
    # Largest first; on equal seconds the first listed (stable and deterministic).
    seconds, bound = max(terms, key=lambda t: t[0])
    return Floor(seconds, bound)
