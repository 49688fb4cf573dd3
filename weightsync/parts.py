"""Which trainer host sends each HF tensor when a version is split over one sender per host.

Pure (no I/O, no torch.distributed): every trainer rank runs it on the same gathered facts and
gets the same plan, so the senders' parts are disjoint, cover every tensor, and carry one
``plan_digest`` without the senders talking to each other.

The rule. A tensor can be sent by a host whose ranks hold a whole copy of it (today: the ranks
that write its pieces; their pieces may not span hosts, as a TP group spanning hosts would).
Largest tensors first, each goes to the least-loaded (by bytes) of its holders, ties to the
smaller host id. Hosts that end up sending nothing have no part; the sending hosts, sorted,
give each part its index. One sending host: the version has one part, sent as today. The
digest is :func:`weightsync.manifest.plan_digest` of the parts (each tensor's name, dtype,
shape and part index), so it is recomputable from the union of the parts.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from weightsync.buckets import TensorSpec
from weightsync.errors import PlanError
from weightsync.manifest import VersionPartSpec, plan_digest


@dataclass(frozen=True)
class PartsPlan:
    """Each sending host's share of every version with this layout."""

    hosts: tuple[str, ...]
    """The sending hosts, sorted: a host's part index is its position here."""
    parts: Mapping[str, tuple[TensorSpec, ...]]
    """Sending host -> its tensors, in manifest order."""
    owner: Mapping[str, str]
    """HF tensor name -> the host that sends it."""
    plan_digest: str
    num_tensors: int

    def tensors_of(self, host: str) -> tuple[TensorSpec, ...]:
        """``host``'s tensors; none for a host that sends nothing."""
        return self.parts.get(host, ())

    def part_of(self, host: str) -> VersionPartSpec | None:
        """``host``'s :class:`VersionPartSpec`; None when the version has one part (or
        ``host`` sends nothing)."""
        if len(self.hosts) < 2 or host not in self.parts:
            return None
        return VersionPartSpec(
            self.hosts.index(host), len(self.hosts), host, self.plan_digest, self.num_tensors
        )

    def bytes_of(self, host: str) -> int:
        return sum(spec.nbytes for spec in self.tensors_of(host))


def plan_parts(
    manifest: Sequence[TensorSpec], copies: Mapping[str, Iterable[Collection[str]]]
) -> PartsPlan:
    """Assign every tensor of ``manifest`` to one sending host, balancing bytes.

    Args:
        manifest: every HF tensor of the version, in manifest order.
        copies: HF name -> the hosts of each whole copy of it the trainer holds (the hosts of
            the ranks holding that copy's pieces). A copy on one host makes that host a
            holder; a copy spread over several hosts cannot be sent by one sender.

    Raises:
        PlanError: a tensor with no copy, or none held within one host (naming the tensor and
            the hosts its pieces are on: TP groups must stay within a host), or duplicate
            names in ``manifest``.
    """
    holders: dict[str, tuple[str, ...]] = {}
    for spec in manifest:
        if spec.name in holders:
            raise PlanError(f"HF tensor {spec.name!r} is listed twice in the manifest")
        spread = [frozenset(c) for c in copies.get(spec.name, ())]
        whole = sorted({next(iter(c)) for c in spread if len(c) == 1})
        if whole:
            holders[spec.name] = tuple(whole)
            continue
        if not any(spread):
            raise PlanError(
                f"HF tensor {spec.name!r} is held by no trainer host; every tensor needs a "
                "rank that writes it"
            )
        hosts = ", ".join(sorted(frozenset().union(*spread)))
        raise PlanError(
            f"HF tensor {spec.name!r} is split over trainer ranks on hosts {hosts}, so no one "
            "host's sender can send it: TP groups must stay within a host (place each "
            "tensor-parallel group's ranks on one host, or set the same WEIGHTSYNC_HOST_ID / "
            "host_id on them)"
        )
    load: dict[str, int] = {h: 0 for hs in holders.values() for h in hs}
    owner: dict[str, str] = {}
    order = sorted(range(len(manifest)), key=lambda i: (-manifest[i].nbytes, i))
    for i in order:
        spec = manifest[i]
        host = min(holders[spec.name], key=lambda h: (load[h], h))
        owner[spec.name] = host
        load[host] += spec.nbytes
    hosts = tuple(sorted(set(owner.values())))
    by_host: dict[str, list[TensorSpec]] = {h: [] for h in hosts}
    for spec in manifest:  # one pass, not one per host: a 1T plan has 32 hosts, 139k tensors
        by_host[owner[spec.name]].append(spec)
    parts = {h: tuple(specs) for h, specs in by_host.items()}
    digest = plan_digest([parts[h] for h in hosts])
    return PartsPlan(hosts, MappingProxyType(parts), MappingProxyType(owner), digest, len(manifest))
