"""All ranks' plans together: :func:`check_coverage` proves that every byte of every HF tensor is
written by exactly one rank; :func:`plan_hosts` then picks the trainer host whose sender sends
each tensor. Pure code on the :class:`~.plan.RankPlan` of each rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from types import MappingProxyType

from weightsync.buckets import TensorSpec
from weightsync.errors import PlanError
from weightsync.parts import PartsPlan, plan_parts

from .pieces import CopyPiece, box_volume, boxes_overlap
from .plan import RankPlan


def check_coverage(plans: Sequence[RankPlan]) -> None:
    """Prove that the ranks' pieces write every byte of every HF tensor exactly once.

    Raises:
        PlanError: naming the HF tensor (and the Megatron parameters / ranks involved) when
            manifests differ, bytes are written twice, or bytes are written by no rank.
    """
    if not plans:
        raise PlanError("no rank plans to check")
    manifest = plans[0].manifest
    for plan in plans[1:]:
        if plan.manifest != manifest:
            theirs = dict((s.name, s) for s in plan.manifest)
            first = next((s for s in manifest if theirs.get(s.name) != s), None)
            raise PlanError(
                f"rank {plan.topology.describe()} planned a different manifest than rank "
                f"{plans[0].topology.describe()} (first difference: {first}); every rank must "
                "use the same HF config and dtype"
            )
    claims: dict[str, list[tuple[RankPlan, CopyPiece]]] = {}
    for plan in plans:
        for name, pieces in plan.pieces.items():
            claims.setdefault(name, []).extend((plan, p) for p in pieces)
    for spec in manifest:
        _check_tensor(spec, claims.get(spec.name, []), plans)


def plan_hosts(
    plans: Sequence[RankPlan],
    hosts: Sequence[str],
    wire: Callable[[TensorSpec], Sequence[TensorSpec]] | None = None,
) -> tuple[list[RankPlan], PartsPlan]:
    """Which trainer host's sender sends each HF tensor, and from which replica.

    ``plans[i]`` (planned with ``every_replica``) runs on ``hosts[i]``. Replica 0 must cover
    every byte exactly once (:func:`check_coverage`). A tensor can be sent by a host whose
    ranks hold a whole data-parallel replica of it; among those, bytes are balanced
    (:func:`~weightsync.parts.plan_parts`), and the lowest such replica on the chosen
    host writes it. Returns each rank's plan narrowed to the pieces it sends (checked again
    when not all are replica 0's), and the parts. ``wire``: each HF tensor as it travels
    (block FP8: its values, then its scales, which the same host sends); default as is.

    Raises:
        PlanError: what :func:`check_coverage` raises; a tensor no host holds a whole replica
            of (naming it and the hosts its pieces are on: TP groups must stay within a
            host); a LoRA adapter exported from several hosts.
    """
    check_coverage(_narrow(plans, lambda name: 0))
    shapes = {spec.name: spec.shape for spec in plans[0].manifest}
    copies: dict[str, dict[int, set[str]]] = {}
    for plan, host in zip(plans, hosts, strict=True):
        for name, pieces in plan.pieces.items():
            # An empty piece (a clipped padding shard) writes nothing, so it pins no host.
            if any(box_volume(p.dst_box(shapes[name])) for p in pieces):
                replica = plan.replica_of.get(name, 0)
                copies.setdefault(name, {}).setdefault(replica, set()).add(host)
    forms = [(spec.name, wire(spec) if wire else (spec,)) for spec in plans[0].manifest]
    parts = plan_parts(
        [w for _, ws in forms for w in ws],
        {w.name: list(copies[name].values()) for name, ws in forms if name in copies for w in ws},
    )
    lora = plans[0].lora
    if lora is not None and len(parts.hosts) > 1:
        raise PlanError(
            f"LoRA adapter {lora.name!r}: its tensors would be sent by the senders of "
            f"{len(parts.hosts)} trainer hosts ({', '.join(parts.hosts)}); exporting an adapter "
            "from several hosts is not supported yet: publish it from ranks on one host"
        )
    chosen = {
        name: min(r for r, on in by_replica.items() if on == {parts.owner[name]})
        for name, by_replica in copies.items()
    }
    narrowed = _narrow(plans, chosen.get)
    if any(chosen.values()):
        check_coverage(narrowed)
    return narrowed, parts


def _narrow(plans: Sequence[RankPlan], replica: Callable[[str], int | None]) -> list[RankPlan]:
    """Each plan with only its pieces of the replica ``replica(name)`` of each tensor."""
    return [
        replace(
            plan,
            pieces=MappingProxyType(
                {
                    name: pieces
                    for name, pieces in plan.pieces.items()
                    if plan.replica_of.get(name, 0) == replica(name)
                }
            ),
        )
        for plan in plans
    ]


def _check_tensor(
    spec: TensorSpec, claims: list[tuple[RankPlan, CopyPiece]], plans: Sequence[RankPlan]
) -> None:
    boxes = sorted(((p.dst_box(spec.shape), plan, p) for plan, p in claims), key=lambda c: c[0])
    for i, (box, plan, piece) in enumerate(boxes):
        for other_box, other_plan, other in boxes[i + 1 :]:
            if spec.shape and other_box[0][0] >= box[0][1]:
                break
            if boxes_overlap(box, other_box):
                raise PlanError(
                    f"HF tensor {spec.name!r} is written twice: by Megatron parameter "
                    f"{_param(plan, piece)!r} on rank {plan.topology.describe()} and by "
                    f"{_param(other_plan, other)!r} on rank {other_plan.topology.describe()}; "
                    "two ranks claim the same shard (duplicate or mislabelled rank coordinates?)"
                )
    written = sum(box_volume(box) for box, _, _ in boxes)
    if written != spec.numel:
        missing = _missing_ranks(plans)
        hint = f"missing ranks: {', '.join(missing)}" if missing else "no rank is missing"
        raise PlanError(
            f"HF tensor {spec.name!r}: {spec.numel - written} of {spec.numel} elements are "
            f"written by no rank ({hint}; is every rank's plan included and every Megatron "
            "parameter registered?)"
        )


def _param(plan: RankPlan, piece: CopyPiece) -> str:
    shard = plan.shards.get(piece.shard_key)
    return shard.name if shard else piece.shard_key


def _missing_ranks(plans: Sequence[RankPlan]) -> list[str]:
    """Writer coordinates (dense: tp x pp; experts: etp x ep x pp) that no plan has."""
    t = plans[0].topology
    dense = {(p.topology.tp_rank, p.topology.pp_rank) for p in plans if p.topology.dp_rank == 0}
    expert = {
        (p.topology.etp_rank, p.topology.ep_rank, p.topology.pp_rank)
        for p in plans
        if p.topology.edp_rank == 0
    }
    out = [
        f"tp{tp} pp{pp}"
        for pp in range(t.pp_size)
        for tp in range(t.tp_size)
        if (tp, pp) not in dense
    ]
    has_experts = any(".experts." in s.name for p in plans for s in p.shards.values())
    if has_experts and (t.ep_size > 1 or t.etp_size > 1):
        out += [
            f"etp{etp} ep{ep} pp{pp}"
            for pp in range(t.pp_size)
            for ep in range(t.ep_size)
            for etp in range(t.etp_size)
            if (etp, ep, pp) not in expert
        ]
    return out
