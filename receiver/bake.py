"""The bake: where each received tensor lands in the live model, learned once per layout from
the model's own loaders, for :mod:`.replay` to apply every version.

The model's ``load_weights`` runs over index-valued inputs: element ``i`` of the group's
inputs holds ``BASE + i * STEP`` (int64). Every live parameter's loader is swapped
(:class:`~.loader_dry_run.LoaderSwap`) for one that runs the real loader into an int64
stand-in of the parameter. Afterwards each stand-in element says which input element the
loaders put there (narrowed to a TP shard, transposed, in the ``k`` slot of a packed
``qkv_proj``, in expert 3 of a fused parameter...), or that none did. Each input's elements in
one parameter are then read back as boxes of it, each filled from a strided view of the input:
a :class:`~.replay.Placement`.

Refused (the engine's own path loads them every version), for the whole module:

- a loader that computes rather than moves (a cast through float, ``+ 1``, a product): it
  leaves values that are not ``BASE + i * STEP`` (``STEP`` a prime far above any small offset,
  ``BASE`` no multiple of it), or values that do not follow their input in a second bake over
  inputs shifted by ``SHIFT``;
- a loader that writes constants other than zero (zeros, as vocab padding, are replayed);
- a name that also loads into a module the engine processes after loading;
- a loader that writes or rebinds other state of its module (SGLang's Gemma norm keeps
  ``weight + 1``): while baking every live tensor's data, and every tensor a module holds as a
  plain attribute, is one element broadcast to its shape, so such a write raises, and a
  rebound attribute is put back. So nothing may run the model meanwhile: the targets are
  called on the engine's own thread (vLLM's worker RPC, SGLang's scheduler), between steps.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from weightsync.buckets import TensorSpec
from weightsync.receiver.landings import (
    BASE,
    SHIFT,
    STEP,
    UNTOUCHED,
    computed,
    moves_differ,
    placements,
    shift_differs,
)
from weightsync.receiver.loader_dry_run import LoaderSwap, ResolvedName
from weightsync.receiver.replay import Placement

GROUP_ELEMENTS = 1 << 26
"""Inputs baked per ``load_weights`` call (their stand-ins: 512 MiB of int64, and more where
one module is larger: the bake needs 8 bytes an element of its largest group)."""


class _Refused(Exception):
    """Why a group of names cannot be baked (its load touched what it may not)."""


@dataclass
class Baked:
    """What a bake found: the placements of the names it could replay, and why each module
    it could not replay is refused (those names take the engine's own path)."""

    placements: dict[str, list[Placement]]
    refused: dict[str, str]


def bake(
    model: torch.nn.Module,
    specs: Sequence[TensorSpec],
    resolved: Mapping[str, ResolvedName],
    loading: Mapping[str, torch.Tensor],
    modules: set[str],
    *,
    group_elements: int = GROUP_ELEMENTS,
) -> Baked:
    """Bake the names of ``specs`` that land in ``modules`` (module names of ``resolved``).

    Args:
        loading: per live name, the tensor in loading format (the dry run's ``loading``).
        modules: the modules a replay may write (those served as loaded); a name whose
            loaders write any other is refused.
    """
    swaps = loader_swaps(model, loading)
    wanted = [s for s in specs if s.name in resolved and resolved[s.name].module_name in modules]
    placements: dict[str, list[Placement]] = {s.name: [] for s in wanted}
    refused: dict[str, str] = {}
    groups = list(_groups(wanted, resolved, group_elements))
    while groups:
        group = groups.pop()
        found = _bake_group(model, group, swaps, modules)
        if isinstance(found, str):
            alone = list(_groups(group, resolved, 0))
            if len(alone) > 1:  # one module's loader failed: bake the others without it
                groups += alone
                continue
            for spec in group:
                refused.setdefault(resolved[spec.name].module_name, found)
            continue
        for live_name, got in found.items():
            module = live_name.rpartition(".")[0]
            if isinstance(got, str):
                refused.setdefault(module, got)
            else:
                for p in got:
                    placements[p.name].append(p)
    # A name is replayed whole or not at all: none of its placements in a refused module.
    kept = {
        name: ps
        for name, ps in placements.items()
        if resolved[name].module_name not in refused
        and all(p.live_name.rpartition(".")[0] not in refused for p in ps)
    }
    return Baked(kept, refused)


def _groups(
    specs: Sequence[TensorSpec], resolved: Mapping[str, ResolvedName], limit: int
) -> Iterator[list[TensorSpec]]:
    """``specs`` in groups of whole modules (names loaded together stay together), each of
    about ``limit`` elements."""
    by_module: dict[str, list[TensorSpec]] = {}
    home: dict[str, str] = {}
    for spec in specs:
        hit = resolved[spec.name]
        module = next((home[n] for n in hit.loaded_with if n in home), hit.module_name)
        home[spec.name] = module
        by_module.setdefault(module, []).append(spec)
    group: list[TensorSpec] = []
    size = 0
    for members in by_module.values():
        group += members
        size += sum(math.prod(s.shape) for s in members)
        if size >= limit:
            yield group
            group, size = [], 0
    if group:
        yield group


def _bake_group(
    model: torch.nn.Module,
    group: Sequence[TensorSpec],
    swaps: Mapping[str, LoaderSwap],
    modules: set[str],
) -> dict[str, list[Placement] | str] | str:
    """Run ``load_weights`` over ``group`` as indices; per live tensor written, its placements
    or why it cannot be replayed. A string: why the whole group cannot.

    Memory: the inputs are made one at a time as ``load_weights`` takes them, and each first
    stand-in is read and freed before the second bake, so a group needs one stand-in per live
    tensor it writes (8 bytes an element) and a reading chunk, besides what the loaders keep."""
    index, start = [], 0
    for spec in group:
        index.append((spec.name, start, math.prod(spec.shape)))
        start += index[-1][2]
    read: dict[str, list[Placement] | str] = {}
    kept: dict[str, torch.Tensor] = {}  # first stand-ins refused other than as computed
    try:
        first = loaded_stand_ins(model, _inputs(group, 0), swaps, modules, untouched=UNTOUCHED)
        for name in list(first):
            stand_in = first.pop(name)
            read[name] = placements(name, stand_in, index)
            if isinstance(read[name], str) and read[name] != computed(name):
                kept[name] = stand_in
            del stand_in
        second = loaded_stand_ins(
            model, _inputs(group, SHIFT), swaps, modules, untouched=UNTOUCHED - 1
        )
    except _Refused as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - any failure means: not replayable, engine path
        return f"its load_weights failed on index values: {type(e).__name__}: {e}"
    for name, got in read.items():
        shifted = second.pop(name, None)
        if shifted is None:
            read[name] = computed(name)
        elif isinstance(got, list):
            if shift_differs(shifted, got, index):
                read[name] = computed(name)
        elif name in kept and moves_differ(kept.pop(name), shifted):
            read[name] = computed(name)
        del shifted
    return read


def _inputs(group: Sequence[TensorSpec], shift: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The group's index-valued inputs (plus ``shift``), each made as it is taken."""
    start = 0
    for spec in group:
        n = math.prod(spec.shape)
        values = torch.arange(start, start + n, dtype=torch.int64).mul_(STEP).add_(BASE + shift)
        yield spec.name, values.view(spec.shape)
        start += n


def loader_swaps(
    model: torch.nn.Module, loading: Mapping[str, torch.Tensor]
) -> dict[str, LoaderSwap]:
    """A :class:`~.loader_dry_run.LoaderSwap` per live parameter (``loading``: the dry run's)."""
    return {n: LoaderSwap(n, p, loading.get(n, p)) for n, p in model.named_parameters()}


def loaded_stand_ins(
    model: torch.nn.Module,
    inputs: Iterable[tuple[str, torch.Tensor]],
    swaps: Mapping[str, LoaderSwap],
    modules: set[str],
    *,
    untouched: int | None,
) -> dict[str, torch.Tensor]:
    """The model's own ``load_weights`` and loaders writing ``inputs`` into fresh stand-ins of
    the loading-format parameters of ``modules`` (on CPU), by live name: int64 filled with
    ``untouched``, or (None) zeros of the parameter's dtype. The live model is not touched.

    Raises:
        _Refused: the loaders wrote a module not in ``modules`` or rebound module state.
    """
    stand_ins: dict[str, torch.Tensor] = {}
    foreign: list[str] = []
    for swap in swaps.values():
        swap.install(_stand_in_loader(swap, stand_ins, modules, untouched, foreign))
    try:
        with _guarded(model), torch.no_grad():
            model.load_weights(iter(inputs))
    finally:
        for swap in swaps.values():
            swap.restore()
    if foreign:
        raise _Refused(f"they also load into {foreign[0]!r}, which is processed after loading")
    return stand_ins


def _stand_in_loader(
    swap: LoaderSwap,
    stand_ins: dict[str, torch.Tensor],
    modules: set[str],
    untouched: int | None,
    foreign: list[str],
) -> Callable:
    mine = swap.name.rpartition(".")[0] in modules

    def load(param: torch.Tensor, loaded_weight: torch.Tensor, *args, **kwargs) -> object:
        loaded = loaded_weight  # the engines pass it by this name too
        if not mine:  # not to be replayed: the names that load here cannot be
            foreign.append(swap.name)
            return swap.loader(swap.meta, loaded.to("meta"), *args, **kwargs)
        stand_in = stand_ins.get(swap.name)
        if stand_in is None:
            meta = swap.meta
            stand_in = (
                torch.zeros(meta.shape, dtype=meta.dtype)
                if untouched is None
                else torch.full(meta.shape, untouched, dtype=torch.int64)
            )
            stand_in.__class__ = meta.__class__
            stand_in.__dict__ = meta.__dict__.copy()
            # Atomic: SGLang's DeepSeek runs its loaders in a thread pool.
            stand_in = stand_ins.setdefault(swap.name, stand_in)
        if not swap.own_loader:
            stand_in.data.copy_(loaded)
            return None
        return swap.loader(stand_in, loaded, *args, **kwargs)

    return load


@contextlib.contextmanager
def _guarded(model: torch.nn.Module) -> Iterator[None]:
    """While baking: every live tensor's data, and every tensor a module holds as a plain
    attribute, one element broadcast to its shape (a write raises); rebound attributes put
    back after, and reported (:class:`_Refused`)."""
    held = {
        (path, name): value
        for path, module in model.named_modules()
        for name, value in vars(module).items()
        if isinstance(value, torch.Tensor)
    }
    tensors = [*model.parameters(), *model.buffers(), *held.values()]
    saved = []
    for tensor in {id(t): t for t in tensors}.values():
        data = tensor.data
        saved.append((tensor, data))
        tensor.data = data.new_zeros(1).expand(data.shape) if data.dim() else data.new_zeros(())
    try:
        yield
    finally:
        for tensor, data in saved:
            tensor.data = data
        rebound = []
        for (path, name), value in held.items():
            module = model.get_submodule(path)
            if vars(module).get(name) is not value:
                setattr(module, name, value)
                rebound.append(f"{path}.{name}")
    if rebound:
        raise _Refused(f"its loaders rebind {rebound[0]!r}")
