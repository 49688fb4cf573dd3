"""vLLM's layerwise reload as weightsync's vLLM target drives it: the loading-format view of
a model (vLLM's recorded pre-processing metadata), the MoE kernel reset vLLM-CPU needs before
an in-place reload, and the checks that a version reloads whole layers and that the model's
``load_weights`` took every name it was given.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from weightsync.errors import ManifestMismatchError
from weightsync.receiver.name_resolver import ResolvedName, live_tensors

# Layerwise reload leaves these alone (vLLM builds them outside create_weights), so a partial
# update need not cover them; see vllm.model_executor.model_loader.reload.meta.SKIP_TENSORS.
_NOT_RELOADED = frozenset({"bias", "e_score_correction_bias"})


def layerwise_module() -> Any | None:
    """vLLM's layerwise reload module, or None on versions without it."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError:
        return None
    return layerwise


def loading_view(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors in loading (checkpoint) format, by live name.

    vLLM records every layer's pre-processing parameters as meta tensors for layerwise
    reload; after processing the live ones may be repacked (vLLM-CPU leaves 0-element
    placeholders), so shapes and weight loaders come from the recorded metadata.
    """
    tensors = live_tensors(model)
    layerwise = layerwise_module()
    if layerwise is None:
        return tensors
    for path, module in model.named_modules():
        info = layerwise.LAYERWISE_INFO.get(module)
        if info is None:
            continue
        params, _buffers = info.restore_metadata
        for attr, meta in params.items():
            tensors[f"{path}.{attr}" if path else attr] = _with_layer_refs(meta, module)
    return tensors


def _with_layer_refs(meta: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """A copy of recorded metadata whose weight loader is bound to ``layer`` again.

    vLLM stores the metadata with loaders unbound (no reference cycles); the stored
    tensor itself stays untouched.
    """
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    copy = meta.data.to("meta")
    copy.__class__ = meta.__class__
    copy.__dict__ = meta.__dict__.copy()
    return restore_layer_refs(copy, layer)


def moe_kernel_reset(model: torch.nn.Module, module_names: set[str]) -> list[tuple[Any, Any]]:
    """Drop the cached fused-MoE kernels of the reloaded modules; return what was dropped.

    vLLM-CPU 0.32 skips its expert pre-pack when ``quant_method.moe_kernel`` is already set,
    so an in-place reload of an MoE model would keep serving the OLD packed experts. Only
    modules that will be reloaded are reset: an untouched one is never re-processed, and a
    layer with no kernel cannot run.
    """
    dropped = []
    for name, module in model.named_modules():
        quant_method = getattr(module, "quant_method", None)
        kernel = getattr(quant_method, "moe_kernel", None)
        if name in module_names and kernel is not None:
            dropped.append((quant_method, kernel))
            quant_method.moe_kernel = None
    return dropped


@contextlib.contextmanager
def no_mtp_check() -> Iterator[None]:
    """A bucket holds part of the model; vLLM must not demand the MTP layers in each one."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
    except ImportError:
        yield
        return
    with disable_mtp_completeness_check():
        yield


def _strip_base_layer(name: str) -> str:
    return name.replace(".base_layer.", ".")


def check_whole_layers(
    resolved: dict[str, ResolvedName], view: dict[str, torch.Tensor], model: torch.nn.Module
) -> None:
    """A layer touched by the version must be loaded whole.

    Layerwise reload rebuilds a touched layer from what arrives; a parameter (or a packed
    slice of one) left out would come back uninitialized rather than keep its old value.
    """
    hit_params: dict[str, set[tuple[Any, Any]]] = defaultdict(set)
    for hit in resolved.values():
        hit_params[hit.live_name].add((hit.shard_id, hit.expert_id))
    packed = dict(getattr(model, "packed_modules_mapping", {}))
    for module_name in {h.module_name for h in resolved.values()}:
        prefix = f"{module_name}."
        derived = _derived_after_loading(model.get_submodule(module_name))
        for live_name in view:
            attr = live_name[len(prefix) :]
            if not live_name.startswith(prefix) or "." in attr or attr in _NOT_RELOADED:
                continue
            if attr in derived:
                continue
            if not isinstance(view[live_name], torch.nn.Parameter):
                continue
            example = next(n for n, h in resolved.items() if h.module_name == module_name)
            if live_name not in hit_params:
                raise ManifestMismatchError(
                    f"partial update: {example!r} reloads layer {module_name!r} but nothing "
                    f"in the version loads its {attr!r}; send every tensor of that layer"
                )
            shards = {s for s, e in hit_params[live_name] if e is None and s is not None}
            leaf = _strip_base_layer(module_name).rpartition(".")[2]
            expected = len(packed.get(leaf, ()))
            if shards and expected and len(shards) != expected:
                raise ManifestMismatchError(
                    f"partial update: layer {module_name!r} is packed from {expected} "
                    f"checkpoint tensors but the version has {len(shards)} (e.g. {example!r}); "
                    "send all of them"
                )


def _derived_after_loading(layer: torch.nn.Module) -> frozenset[str]:
    """Parameters of ``layer`` that post-load processing creates, which no checkpoint holds.

    Online quantization (``quantization="fp8_per_block"``) loads bf16 ``weight`` s and adds
    ``weight_scale_inv`` while quantizing; layerwise reload restores the recorded loading
    layout (without it) and quantizes again, so a version needs not (and cannot) send it.
    """
    layerwise = layerwise_module()
    info = None if layerwise is None else layerwise.LAYERWISE_INFO.get(layer)
    recorded = {} if info is None else info.restore_metadata[0]
    if not recorded:
        return frozenset()
    return frozenset(name for name, _ in layer.named_parameters(recurse=False)) - set(recorded)


def check_loaded(
    batch: Sequence[tuple[str, torch.Tensor]],
    resolved: dict[str, ResolvedName],
    loaded: Any,
) -> None:
    """Exactness: a name the model silently skipped would leave old weights in place."""
    if loaded is None:  # models whose load_weights returns nothing: nothing to check against
        return
    got = {_strip_base_layer(n) for n in loaded}
    skipped = [name for name, _ in batch if _strip_base_layer(resolved[name].live_name) not in got]
    if skipped:
        raise ManifestMismatchError(
            f"the model's load_weights skipped {skipped[:5]} (it resolved them, but did not "
            "load them; a tied lm_head is loaded through the embedding); drop them from "
            "the version"
        )
