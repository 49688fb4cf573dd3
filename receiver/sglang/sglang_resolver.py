"""SGLang's side of name resolution: what the live SGLang model exposes, fed to the generic
:class:`~weightsync.receiver.name_resolver.NameResolver`.

The generic resolver probes ``packed_modules_mapping`` and modules' ``get_expert_mapping()``
(vLLM's spellings). SGLang 0.5 models expose the same facts differently, so this module
translates, still without per-model tables:

- packed modules: ``packed_modules_mapping`` where the model has it (Qwen3-MoE), otherwise
  ``bitsandbytes_stacked_params_mapping`` (``{"q_proj": ("qkv_proj", 0), ...}``: Qwen2, Llama,
  Qwen3), which every SGLang model with packed layers declares for its quantized loader;
- fused experts: every module with ``make_expert_params_mapping`` and ``num_experts``
  (SGLang's ``FusedMoE``), asked for its mapping under each per-expert checkpoint naming HF
  uses (``gate_proj/down_proj/up_proj`` and Mixtral's ``w1/w2/w3``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from weightsync.buckets import TensorSpec
from weightsync.errors import ManifestMismatchError
from weightsync.receiver.name_resolver import ExpertMapping, NameResolver, ResolvedName

# Per-expert checkpoint names as (gate, down, up): HF's two conventions, not per-model data.
EXPERT_CHECKPOINT_NAMES: tuple[tuple[str, str, str], ...] = (
    ("gate_proj", "down_proj", "up_proj"),
    ("w1", "w2", "w3"),
)


def packed_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}`` from what the SGLang model declares."""
    declared = getattr(model, "packed_modules_mapping", None)
    if declared:
        return {packed: list(members) for packed, members in declared.items()}
    stacked: Mapping[str, tuple[str, int]] = (
        getattr(model, "bitsandbytes_stacked_params_mapping", None) or {}
    )
    by_packed: dict[str, list[tuple[int, str]]] = {}
    for member, (packed, index) in stacked.items():
        # Llama spells them as name fragments (".q_proj": (".qkv_proj", 0)).
        by_packed.setdefault(packed.strip("."), []).append((index, member.strip(".")))
    return {packed: [m for _, m in sorted(members)] for packed, members in by_packed.items()}


def expert_mapping(module: torch.nn.Module) -> ExpertMapping:
    """Every per-expert checkpoint fragment a fused-MoE module loads, for both conventions."""
    make = getattr(module, "make_expert_params_mapping", None)
    num_experts = getattr(module, "num_experts", None)
    if not callable(make) or not isinstance(num_experts, int):
        return []
    mapping: ExpertMapping = []
    for gate, down, up in EXPERT_CHECKPOINT_NAMES:
        mapping.extend(
            make(
                ckpt_gate_proj_name=gate,
                ckpt_down_proj_name=down,
                ckpt_up_proj_name=up,
                num_experts=num_experts,
            )
        )
    return mapping


def sglang_resolver(
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor] | None = None
) -> NameResolver:
    """The generic resolver, fed with SGLang's packed-module and fused-expert metadata."""
    return NameResolver(
        model, tensors, packed_modules=packed_modules(model), expert_mapping=expert_mapping
    )


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
    resolver: NameResolver, specs: list[TensorSpec], resolved: Mapping[str, ResolvedName]
) -> None:
    """Fused-expert tensors must have exactly the expert's checkpoint shape.

    SGLang's ``FusedMoE`` loader accepts a SMALLER tensor (it zero-fills the rest, for padded
    layouts), so the dry run alone would let a wrongly planned expert through.

    Raises:
        ManifestMismatchError: the first expert tensor of another shape.
    """
    for spec in specs:
        hit = resolved[spec.name]
        if hit.expert_id is None:
            continue
        module = resolver.model.get_submodule(hit.module_name)
        expected = expert_checkpoint_shape(module, str(hit.shard_id))
        if expected is not None and spec.shape != expected:
            raise ManifestMismatchError(
                f"{spec.name!r} has shape {list(spec.shape)} but expert {hit.expert_id} of "
                f"live {hit.module_name!r} loads {list(expected)} (shard {hit.shard_id!r}); "
                "check the MoE sizes the sender planned with"
            )
