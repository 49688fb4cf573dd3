"""Resolve checkpoint (HF) tensor names against a LIVE engine model, without per-model tables:
the model's own ``load_weights`` says where each name lands (:mod:`.loader_dry_run` runs it on
meta tensors), and its parameters' own weight loaders check each shape (vocab padding, tensor
parallel slicing, packed offsets, experts) before any byte is written.

Also here: which names an engine may set aside (the MTP layers its config declares), the
error for names no model of an engine loads, the boxes a TP rank keeps, and tied aliases.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from weightsync.buckets import TensorSpec
from weightsync.errors import ManifestMismatchError, NameResolutionError
from weightsync.receiver.loader_dry_run import (
    DryRun,
    ResolvedName,
    ShardId,
    dry_run,
    live_tensors,
)
from weightsync.receiver.reads import bounding
from weightsync.topology_model import Box

__all__ = [
    "MtpLayers",
    "ResolvedName",
    "aliases",
    "kept_boxes",
    "live_tensors",
    "mtp_names_left",
    "refuse_unknown",
    "resolve_accepted",
    "resolve_by_loading",
    "unknown_names_error",
]

_LISTED = 8


def resolve_by_loading(
    model: torch.nn.Module,
    specs: Sequence[TensorSpec],
    loading: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, ResolvedName]:
    """Where each spec's tensor lands in ``model``, learned from its own ``load_weights``.

    Every live parameter's ``weight_loader`` is swapped for a recorder and ``load_weights``
    runs once over META tensors of the specs' names, shapes and dtypes: each loader call the
    model makes says which checkpoint name lands in which live parameter, with which shard
    and expert arguments; the parameter's REAL loader then runs with the same arguments on a
    meta copy, so the engine's own slicing (TP, packed offsets, experts, a transposed Conv1D)
    checks the shape. Nothing is written: the inputs are meta tensors, real loaders see meta
    parameters only, and code that bypasses ``weight_loader`` cannot copy out of a meta tensor.
    A name the model takes nowhere (unknown, or a tied ``lm_head``) is unresolved. Cost: one
    pass of the model's own loader, linear in names.

    Args:
        model: the live engine model (vLLM / SGLang), with ``load_weights``.
        specs: the checkpoint tensors to resolve.
        loading: per live name, the tensor in loading format to check against (vLLM's
            recorded metadata, when post-processing repacked the live weights); default the
            live parameters.

    Raises:
        NameResolutionError: names the model loads nowhere (all of them, in one message).
        ManifestMismatchError: the first tensor whose dtype or shape the live model rejects,
            or two names loading into the same live slice.
    """
    run = dry_run(model, specs, loading)
    unresolved = [s.name for s in run.specs if s.name not in run.hits]
    if unresolved:
        raise unknown_names_error(type(model).__name__, unresolved, run.refused)
    return _checked(run)


def resolve_accepted(
    model: torch.nn.Module,
    specs: Sequence[TensorSpec],
    loading: Mapping[str, torch.Tensor] | None = None,
    *,
    elsewhere: Callable[[str], bool] | None = None,
) -> tuple[dict[str, ResolvedName], list[str]]:
    """:func:`resolve_by_loading` for the names ``model`` takes; the others are left out.

    For a version split over several models (a target model and its MTP draft model, each
    taking its own layers): the caller decides what to do with names no model takes.

    Args:
        elsewhere: true for a live name that belongs to another model, which loads it itself
            (vLLM's MTP draft model shares the target's embedding and lm_head modules).

    Returns:
        Where each taken name lands, checked; and, apart and unchecked, the names that land
        only in live tensors ``elsewhere``.

    Raises:
        ManifestMismatchError: as :func:`resolve_by_loading`, for the names the model takes.
    """
    run = dry_run(model, specs, loading)
    apart = [
        name
        for name, hits in run.hits.items()
        if elsewhere is not None and all(elsewhere(hit.live_name) for hit in hits)
    ]
    for name in apart:
        del run.hits[name]
        run.misfits.pop(name, None)
    run.call_of = {key: call for key, call in run.call_of.items() if key[0] in run.hits}
    return _checked(run), apart


def _checked(run: DryRun) -> dict[str, ResolvedName]:
    """The dry run's landing places of the names it resolved, after checking their dtype,
    their fit (the real loaders' verdict) and that no two names load into one live slice."""
    dtypes = {entry.name: entry.meta.dtype for entry in run.params}
    seen: dict[tuple[str, ShardId | None, int | None], tuple[str, int]] = {}
    for spec in run.specs:
        if spec.name not in run.hits:
            continue
        if spec.name in run.misfits:
            raise ManifestMismatchError(
                f"{spec.name!r} with shape {list(spec.shape)} {run.misfits[spec.name]}. Check "
                "the model config the sender planned with."
            )
        for index, hit in enumerate(run.hits[spec.name]):
            if spec.torch_dtype != dtypes[hit.live_name]:
                raise ManifestMismatchError(
                    f"{spec.name!r} is {spec.dtype} but live {hit.live_name!r} is "
                    f"{dtypes[hit.live_name]}; publish it in the engine's dtype."
                )
            # Inputs the model concatenated into one call share it; two calls may not.
            key = (hit.live_name, hit.shard_id, hit.expert_id)
            call = run.call_of[(spec.name, index)]
            first, first_call = seen.setdefault(key, (spec.name, call))
            if first != spec.name and first_call != call:
                raise ManifestMismatchError(
                    f"{spec.name!r} and {first!r} both load into live {hit.live_name!r} "
                    f"(shard {hit.shard_id!r}); send only one of them."
                )
    by_call: dict[int, set[str]] = {}
    for (name, _), call in run.call_of.items():
        by_call.setdefault(call, set()).add(name)
    partners: dict[str, frozenset[str]] = {}
    for names in by_call.values():
        for name in names if len(names) > 1 else ():
            partners[name] = partners.get(name, frozenset()) | (names - {name})
    shapes = {spec.name: spec.shape for spec in run.specs}
    return {
        name: replace(
            _summary(hits, partners.get(name, frozenset())),
            box=run.reads.kept(name, shapes[name]),
        )
        for name, hits in run.hits.items()
    }


def _summary(hits: list[ResolvedName], loaded_with: frozenset[str]) -> ResolvedName:
    """One name's landing place: its first loader call, without an expert id when the model
    spread one checkpoint tensor over several experts (GraniteMoE's stacked experts)."""
    first = replace(hits[0], loaded_with=loaded_with) if loaded_with else hits[0]
    if len(hits) > 1 and len({hit.expert_id for hit in hits}) > 1:
        return replace(first, expert_id=None, expert_weight_name=None)
    return first


def kept_boxes(*resolved: Mapping[str, ResolvedName]) -> dict[str, Box]:
    """The boxes a rank keeps of the names its models resolved (a target model and its
    draft): a name any model loads whole is kept whole, else the box holding every model's."""
    boxes: dict[str, list[Box]] = {}
    whole: set[str] = set()
    for names in resolved:
        for name, hit in names.items():
            if hit.box is None:
                whole.add(name)
            else:
                boxes.setdefault(name, []).append(hit.box)
    return {name: bounding(b) for name, b in boxes.items() if name not in whole}


MTP_LAYER_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
"""Config fields that declare a model's MTP layers: DeepSeek-V3, GLM-4.5, Qwen3-Next, MiMo
(``num_nextn_predict_layers``); Qwen3.5 (``mtp_num_hidden_layers``)."""


@dataclass(frozen=True)
class MtpLayers:
    """The MTP layers a model's config declares: ``count`` of them, after its
    ``num_hidden_layers`` decoder layers."""

    num_hidden_layers: int
    count: int

    @classmethod
    def of(cls, config: object) -> MtpLayers | None:
        """What ``config`` (an HF config) declares; None where it declares no MTP layer."""
        layers = getattr(config, "num_hidden_layers", None)
        counts = [getattr(config, field, None) for field in MTP_LAYER_FIELDS]
        count = next((c for c in counts if isinstance(c, int) and c > 0), 0)
        return cls(layers, count) if isinstance(layers, int) and count else None

    def holds(self, name: str) -> bool:
        """``name`` is one of the declared MTP layers' checkpoint names: ``mtp.*`` (Qwen3-Next,
        Qwen3.5; ``mtp.layers.{i}`` with i < count) or a decoder layer just past the model's
        last one (DeepSeek-V3, GLM-4.5: ``model.layers.{N + i}``, i < count)."""
        parts = name.split(".")
        if "mtp" in parts[:2]:
            index = _layer_index(parts[parts.index("mtp") :])
            return index is None or index < self.count
        index = _layer_index(parts)
        return index is not None and 0 <= index - self.num_hidden_layers < self.count


def _layer_index(parts: Sequence[str]) -> int | None:
    for part, index in zip(parts, parts[1:], strict=False):
        if part == "layers" and index.isdigit():
            return int(index)
    return None


def mtp_names_left(
    specs: Sequence[TensorSpec], loaded: Collection[str], mtp: MtpLayers | None
) -> list[str]:
    """The names among ``specs`` of the MTP layers the config declares (``mtp``) that the model
    does not load (``loaded``): an engine serving without a draft model ignores them (warned
    per version) instead of refusing them, so a trainer that exports MTP is not stuck. Any
    other name the model does not load stays unknown (a layer the model does not have is
    the wrong model, not MTP)."""
    if mtp is None:
        return []
    return [s.name for s in specs if s.name not in loaded and mtp.holds(s.name)]


def refuse_unknown(
    specs: Sequence[TensorSpec], taken: Collection[str], model: object, draft: object = None
) -> None:
    """Raise :func:`unknown_names_error` for the names of ``specs`` not in ``taken`` (loaded by
    ``model`` or its ``draft`` model, or deliberately ignored)."""
    unknown = [spec.name for spec in specs if spec.name not in taken]
    if unknown:
        models = type(model).__name__
        if draft is not None:
            models += f" (nor its draft model {type(draft).__name__})"
        raise unknown_names_error(models, unknown)


def unknown_names_error(
    models: str, names: Sequence[str], why: Mapping[str, str] | None = None
) -> NameResolutionError:
    """The error for checkpoint names no model of an engine loads (``models`` names them;
    ``why``: what the model's own code said of a name, where it refused one)."""
    why = why or {}
    shown = ", ".join(repr(n) + (f" ({why[n]})" if n in why else "") for n in names[:_LISTED])
    more = f" (and {len(names) - _LISTED} more)" if len(names) > _LISTED else ""
    return NameResolutionError(
        f"the live {models} has no tensor for {shown}{more}: its load_weights loads them "
        "nowhere (unknown names, or a tied lm_head that loads through the embedding). Check "
        "the sender's name templates for this architecture, or drop these tensors from the "
        "version."
    )


def aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """For each live name of a tensor the model holds under several names (tied weights), the
    other names (``lm_head.weight`` for ``model.embed_tokens.weight`` and back)."""
    names_of: dict[int, list[str]] = {}
    for name, tensor in live_tensors(model).items():
        names_of.setdefault(id(tensor), []).append(name)
    return {
        name: [other for other in names if other != name]
        for names in names_of.values()
        if len(names) > 1
        for name in names
    }
