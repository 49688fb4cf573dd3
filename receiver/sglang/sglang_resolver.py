"""SGLang's side of name resolution: what the engine's own ``load_weights`` accepts (see
:func:`~weightsync.receiver.name_resolver.resolve_by_loading`), plus the one check its loader
cannot make (fused-expert tensors smaller than the expert).

SGLang models learn their checkpoint names inside ``load_weights`` (a local stacked-params
list, the fused-MoE expert mapping, per-parameter weight loaders); many declare nothing else
(no ``packed_modules_mapping``), so resolution asks the loader itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from weightsync.buckets import TensorSpec
from weightsync.errors import ManifestMismatchError
from weightsync.receiver.name_resolver import ResolvedName


def expert_checkpoint_shape(module: torch.nn.Module, shard_id: str) -> tuple[int, int] | None:
    """The full (unsharded) checkpoint shape of one expert's ``w1``/``w3`` or ``w2`` weight.

    None for modules that do not say (quantized layouts) or that pad the intermediate size
    (their loader takes a smaller checkpoint on purpose).
    """
    hidden = getattr(module, "hidden_size", None)
    local = getattr(module, "intermediate_size_per_partition", None)
    tp = getattr(module, "moe_tp_size", None)
    if not all(isinstance(v, int) for v in (hidden, local, tp)) or getattr(
        module, "use_padded_loading", True
    ):
        return None
    intermediate = local * tp
    return (hidden, intermediate) if shard_id == "w2" else (intermediate, hidden)


def check_expert_shapes(
    model: torch.nn.Module, specs: Sequence[TensorSpec], resolved: Mapping[str, ResolvedName]
) -> None:
    """Fused-expert tensors must have exactly the expert's checkpoint shape.

    SGLang's ``FusedMoE`` loader accepts a SMALLER tensor (it zero-fills the rest, for padded
    layouts), so the dry run alone would let a wrongly planned expert through.

    Raises:
        ManifestMismatchError: the first expert tensor of another shape.
    """
    for spec in specs:
        hit = resolved[spec.name]
        # Quantized experts' scales (block FP8's ``w13_weight_scale_inv``: the expert's grid
        # of blocks) do not have the expert's shape: the check is for the weights.
        if hit.expert_id is None or "_scale" in hit.live_name.rpartition(".")[2]:
            continue
        module = model.get_submodule(hit.module_name)
        expected = expert_checkpoint_shape(module, str(hit.shard_id))
        if expected is not None and spec.shape != expected:
            raise ManifestMismatchError(
                f"{spec.name!r} has shape {list(spec.shape)} but expert {hit.expert_id} of "
                f"live {hit.module_name!r} loads {list(expected)} (shard {hit.shard_id!r}); "
                "check the MoE sizes the sender planned with"
            )
