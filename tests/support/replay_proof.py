"""The proof of a bake: a version replayed from the plan equals, bit for bit, the engine's own
loaders writing the same tensors into fresh loading-format parameters, for every parameter the
plan writes; every parameter it does not write belongs to a module the bake refused, and says
why."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from weightsync.buckets import TensorSpec
from weightsync.receiver.bake import Baked, bake, loaded_stand_ins, loader_swaps
from weightsync.receiver.name_resolver import resolve_by_loading
from weightsync.receiver.replay import ReplayPlan
from weightsync.receiver.target import TensorBox, assembled
from weightsync.regions import CopyBatch


def replay_differs(
    model: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    loading: Mapping[str, torch.Tensor],
    corrupt: Callable[[Baked], None] | None = None,
    served: set[str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The live names where ``tensors`` replayed over an earlier version (other random values)
    differ from the engine's own loading of them, and the modules the bake refused (why).
    ``served``: the modules the engine serves as loaded, the only ones baked (default every
    module: what the engine processes after loading is compared in loading format); each of
    their parameters must be replayed unless the bake refused its module. ``corrupt`` plants a
    fault in the bake first."""
    specs = [TensorSpec.of(name, t) for name, t in tensors.items()]
    resolved = resolve_by_loading(model, specs, loading)
    modules = {name for name, _ in model.named_modules()}
    served = modules if served is None else served
    baked = bake(model, specs, resolved, loading, served)
    if corrupt is not None:
        corrupt(baked)
    # The engine's loaders of the refused modules may not run on stand-ins at all.
    kept = {n: t for n, t in tensors.items() if resolved[n].module_name not in baked.refused}
    swaps = loader_swaps(model, loading)
    # Fresh inputs each time: some loaders change theirs in place (SGLang's Gemma norm += 1).
    earlier = [(n, torch.randn_like(t) if t.is_floating_point() else t) for n, t in kept.items()]
    got = loaded_stand_ins(model, earlier, swaps, modules, untouched=None)
    now = [(n, t.clone()) for n, t in kept.items()]
    want = loaded_stand_ins(model, now, swaps, modules, untouched=None)
    # The same version again, from pieces of each tensor (a sharded trainer's), over the
    # earlier one: placed straight from the pieces, or assembled where a read is no box.
    by_pieces = loaded_stand_ins(model, earlier, swaps, modules, untouched=None)
    plan = ReplayPlan(baked.placements, got)
    written = {p.live_name for ps in baked.placements.values() for p in ps}
    CopyBatch.of(plan.copies([(n, t) for n, t in kept.items() if n in plan])).run()
    pieces_plan = ReplayPlan(baked.placements, by_pieces)
    left = pieces_plan.apply_pieces(
        [b for n, t in kept.items() if n in plan for b in _pieces(n, t)]
    )
    for group in assembled(left):
        pieces_plan.apply(group)
    differing = [
        f"{name}{how}"
        for name in want
        if name in written
        for how, have in (("", got), (" (from pieces)", by_pieces))
        if not torch.equal(have[name].view(-1), want[name].data.view(-1))
    ]
    unexplained = [
        name
        for name in want
        if name not in written
        and name.rpartition(".")[0] in served
        and name.rpartition(".")[0] not in baked.refused
    ]
    return differing + [f"{n} (not replayed, not refused)" for n in unexplained], baked.refused


def _pieces(name: str, tensor: torch.Tensor) -> list[TensorBox]:
    """``tensor`` as up to four boxes: its first two dims each cut in two (uneven halves)."""
    cuts = [[(0, n)] if n < 2 else [(0, n // 2 + 1), (n // 2 + 1, n)] for n in tensor.shape[:2]]
    boxes = []
    for rows in cuts[0] if cuts else [None]:
        for cols in cuts[1] if len(cuts) > 1 else [None]:
            index = tuple(slice(a, b) for a, b in (r for r in (rows, cols) if r is not None))
            start = tuple(r[0] for r in (rows, cols) if r is not None)
            start += (0,) * (tensor.dim() - len(start))
            boxes.append(TensorBox(name, tuple(tensor.shape), start, tensor[index]))
    return boxes
