"""The proof of a bake: a version replayed from the plan equals, bit for bit, the engine's own
loaders writing the same tensors into fresh loading-format parameters, for every parameter the
plan writes; every parameter it does not write belongs to a module the bake refused, and says
why."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from weightsync.buckets import TensorSpec
from weightsync.receiver.name_resolver import resolve_by_loading
from weightsync.receiver.replay import (
    Baked,
    ReplayPlan,
    bake,
    loaded_stand_ins,
    loader_swaps,
)
from weightsync.regions import CopyBatch


def baked(
    model: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    loading: Mapping[str, torch.Tensor],
) -> tuple[Baked, set[str]]:
    """The bake of every module ``tensors`` land in, and those modules."""
    specs = [TensorSpec.of(name, t) for name, t in tensors.items()]
    resolved = resolve_by_loading(model, specs, loading)
    modules = {hit.module_name for hit in resolved.values()}
    return bake(model, specs, resolved, loading, modules), modules


def replay_differs(
    model: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    loading: Mapping[str, torch.Tensor],
    corrupt: Callable[[Baked], None] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The live names where ``tensors`` replayed over an earlier version (other random values)
    differ from the engine's own loading of them, and the modules the bake refused (why).
    ``corrupt`` plants a fault in the bake first."""
    plan_of, modules = baked(model, tensors, loading)
    if corrupt is not None:
        corrupt(plan_of)
    swaps = loader_swaps(model, loading)
    earlier = [(n, torch.randn_like(t) if t.is_floating_point() else t) for n, t in tensors.items()]
    got = loaded_stand_ins(model, earlier, swaps, modules, index=False)
    want = loaded_stand_ins(model, list(tensors.items()), swaps, modules, index=False)
    plan = ReplayPlan(plan_of.placements, got)
    written = {p.live_name for ps in plan_of.placements.values() for p in ps}
    CopyBatch.of(plan.copies([(n, t) for n, t in tensors.items() if n in plan])).run()
    differing = [
        name
        for name in want
        if name in written and not torch.equal(got[name].view(-1), want[name].data.view(-1))
    ]
    unexplained = [
        name
        for name in want
        if name not in written and name.rpartition(".")[0] not in plan_of.refused
    ]
    return differing + [f"{n} (not replayed, not refused)" for n in unexplained], plan_of.refused
