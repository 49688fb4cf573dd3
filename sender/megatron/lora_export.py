"""LoRA adapters trained with Megatron-Bridge's PEFT ``LoRA``: shards -> HF PEFT tensors + config.

megatron-core 0.16.1 has no LoRA modules; the layout below is Megatron-Bridge's
(``src/megatron/bridge/peft/lora.py``, ``lora_layers.py``, ``adapter_wrapper.py``, ``utils.py``
``ParallelLinearAdapter`` / ``get_adapter_attributes_from_linear``, and its HF export in
``models/conversion/peft_bridge.py``), read from its source, not run here:

- ``LoRALinear(AdapterWrapper)`` replaces a target linear; the base linear becomes its
  ``to_wrap`` child and the adapter its ``adapter`` child, so ``named_parameters()`` yields
  ``<module>.to_wrap.weight`` for the frozen base (the name tables drop ``.to_wrap.``, as
  Bridge's own ``_get_lora_unwrapped_name`` does) and ``<module>.adapter.linear_in.weight``
  (A) / ``<module>.adapter.linear_out.weight`` (B). No adapter biases.
- Column-parallel targets (``linear_qkv``, ``linear_fc1``, a gated delta net's ``in_proj``):
  ``linear_in`` is a ``ColumnParallelLinear(in, r, gather_output=True)``, so A is **split on
  its rank dim**: local ``[r/TP, in]``, partition_dim 0 (not replicated). ``linear_out`` is a
  ``ColumnParallelLinear(r, out)``: local ``[out/TP, r]``, rows aligned with the base shard's
  rows, i.e. the QKV group layout for ``linear_qkv`` (with the output gate's rows for gated
  attention), ``[gate_r; up_r]`` for a gated ``linear_fc1`` (Bridge's
  ``_split_fused_fc1_linear_out_weight`` de-interleaves per TP shard) and the per-key-head
  sections for ``in_proj``. So lora_B is placed by the base weight's own rule.
- Row-parallel targets (``linear_proj``, ``linear_fc2``, the GDN's ``out_proj``):
  ``linear_in`` is a ``RowParallelLinear(in, r, input_is_parallel=True)``: local
  ``[r, in/TP]``, partition_dim 1; ``linear_out`` is again a ``ColumnParallelLinear(r, out,
  gather_output=True)``: local ``[out/TP, r]``, partition_dim 0 (**split, not replicated**;
  ``LoRAMerge.merge`` gathers it).
- Scale ``alpha / r`` (``ParallelLinearAdapter``), the same as PEFT's ``lora_alpha / r``
  without rsLoRA. Bridge's HF export maps ``linear_in`` -> ``lora_A`` and ``linear_out`` ->
  ``lora_B``; a packed target's lora_A goes unchanged to every HF module it feeds
  (q/k/v, gate/up, the GDN's ``in_proj_qkv`` / ``_z`` / ``_b`` / ``_a``) and its lora_B is
  split like the base weight.

HF names are PEFT's ``save_pretrained`` names (``base_model.model.<hf module>.lora_A.weight``),
which vLLM's and SGLang's adapter loaders read. Not covered (a PlanError names the parameter):
Bridge's ``CanonicalLoRA`` (``adapter.adapter_q...``), expert / shared-expert / router adapters,
adapters inside MTP layers, DoRA.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from weightsync.buckets import TensorSpec
from weightsync.errors import PlanError
from weightsync.manifest import LoraAdapterSpec

from .dims import ModelDims
from .name_mapping import ParamMapping
from .name_table import NameTable
from .pieces import CopyPiece
from .rules import (
    ColumnRule,
    GatedFc1Rule,
    HeadSectionsRule,
    Placed,
    QKVRule,
    RowRule,
    Rule,
    ShardContext,
)
from .shards import ShardMeta

TARGETS = {
    "linear_qkv": "self_attention.linear_qkv",
    "linear_proj": "self_attention.linear_proj",
    "in_proj": "self_attention.in_proj",
    "out_proj": "self_attention.out_proj",
    "linear_fc1": "mlp.linear_fc1",
    "linear_fc2": "mlp.linear_fc2",
}
"""Bridge ``LoRA.target_modules`` names -> module path inside a decoder layer (manifest order);
``in_proj`` / ``out_proj`` are the gated delta net's (Qwen3-Next / Qwen3.5 linear-attention
layers), which Bridge wraps when named in ``target_modules``."""

_ADAPTER = re.compile(
    r"^decoder\.layers\.(\d+)\.(" + "|".join(re.escape(p) for p in TARGETS.values()) + r")"
    r"\.adapter\.(linear_in|linear_out)\.weight$"
)
_KIND = {path: kind for kind, path in TARGETS.items()}
PEFT_PREFIX = "base_model.model."


def is_adapter(name: str) -> bool:
    """True for a Bridge adapter parameter (anything under an ``.adapter.`` child)."""
    return ".adapter." in name


def peft_name(hf_weight: str, which: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> PEFT's saved ``...q_proj.lora_A.weight``."""
    return PEFT_PREFIX + hf_weight.removesuffix(".weight") + f".{which}.weight"


@dataclass(frozen=True)
class LoraExport:
    """How to export the LoRA adapter a Megatron-Bridge model carries.

    ``rank`` and ``targets`` are read from the adapter shards when None; give them when a
    rank may hold no adapter (e.g. a pipeline stage without decoder layers), so every rank
    plans the same manifest.
    """

    name: str
    """The adapter name engines register it under."""
    alpha: float
    """Bridge's ``LoRA.alpha`` (scale ``alpha / r``; becomes PEFT's ``lora_alpha``)."""
    rank: int | None = None
    """Bridge's ``LoRA.dim`` (PEFT ``r``)."""
    targets: tuple[str, ...] | None = None
    """Bridge target kinds (keys of :data:`TARGETS`); adapters are on every layer that has
    the target's base weight."""
    dtype: str | None = None
    """Wire dtype of the adapter tensors; default: the plan's dtype, else the shards'."""
    base_model_name_or_path: str | None = None
    """Recorded in ``adapter_config.json`` (PEFT's field)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise PlanError("LoraExport needs a non-empty adapter name")
        unknown = [t for t in self.targets or () if t not in TARGETS]
        if unknown:
            raise PlanError(f"LoRA target {unknown[0]!r} is not one of {sorted(TARGETS)}")


@dataclass(frozen=True)
class SharedColumnRule(Rule):
    """A column-parallel lora_A ``[r/TP, in]`` copied into every HF module it feeds."""

    partition_dim: int | None = 0

    def place(self, ctx: ShardContext) -> Placed:
        full = ctx.dims.shape(self.shapes[0])
        n = ctx.split(full[0], "LoRA rank")
        ctx.expect_shape((n, *full[1:]), f"lora_A of rank {full[0]} split {ctx.size} ways")
        dst = ((0, ctx.rank * n, n),)
        # The same shard region goes to each module: PEFT keeps one lora_A per module.
        return [(ctx.hf_name(t), CopyPiece(ctx.shard.key, dst=dst)) for t in self.hf]


@dataclass(frozen=True)
class AdapterPlan:
    """The adapter part of one rank's plan (``plan_rank`` merges it in)."""

    specs: tuple[TensorSpec, ...]
    mappings: dict[str, ParamMapping]
    """Adapter shard key -> its mapping (rules carry the concrete rank ``r``)."""
    spec: LoraAdapterSpec


def adapter_rules(base: Rule, r: int, param: str) -> tuple[Rule, Rule]:
    """lora_A and lora_B rules for an adapter on a target whose base weight uses ``base``."""
    a_names = tuple(peft_name(n, "lora_A") for n in base.hf)
    b_names = tuple(peft_name(n, "lora_B") for n in base.hf)
    rows = tuple(shape[0] for shape in base.shapes)
    cols = base.shapes[0][1]
    if isinstance(base, RowRule):
        return RowRule(a_names, ((r, cols),)), ColumnRule(b_names, ((rows[0], r),))
    if isinstance(base, (QKVRule, GatedFc1Rule, HeadSectionsRule, ColumnRule)):
        # lora_B rows follow the base weight's rows: the base rule, with its layout fields
        # (QKV output gate, GDN sections), places them; only names and widths change.
        a_rule = SharedColumnRule(a_names, tuple((r, cols) for _ in a_names))
        return a_rule, replace(base, hf=b_names, shapes=tuple((row, r) for row in rows))
    raise PlanError(
        f"LoRA adapter parameter {param!r}: its base weight uses {type(base).__name__}, which "
        "has no LoRA rule"
    )


def _base_mapping(table: NameTable, dims: ModelDims, path: str, layer: int) -> ParamMapping | None:
    """The mapping of a target's base weight in ``layer``; None when the HF layer lacks it."""
    mappings = table.by_template.get(f"decoder.layers.{{layer}}.{path}.weight", ())
    holding = [m for m in mappings if dims.holds(m.when, layer)]
    return holding[0] if len(holding) == 1 else None


def _parse(shard: ShardMeta) -> tuple[str, str]:
    """(target kind, ``linear_in`` | ``linear_out``) of an adapter shard; PlanError if unknown."""
    match = _ADAPTER.match(shard.name)
    if match is None:
        raise PlanError(
            f"Megatron parameter {shard.name!r} is a LoRA adapter weight with no rule: only "
            f"Bridge LoRA on decoder layers' {sorted(TARGETS)} is exported (no CanonicalLoRA, "
            "expert, router or MTP adapters)"
        )
    return _KIND[match.group(2)], match.group(3)


def _infer_rank(
    adapters: Sequence[tuple[ShardMeta, str, str]], table: NameTable, dims: ModelDims, tp: int
) -> int | None:
    found: dict[int, str] = {}
    for shard, kind, which in adapters:
        if len(shard.shape) != 2:
            raise PlanError(f"LoRA adapter parameter {shard.name!r} is not 2-D: {shard.shape}")
        base = _base_mapping(table, dims, TARGETS[kind], shard.layer or 0)
        row_target = base is not None and isinstance(base.rule, RowRule)
        if which == "linear_out":
            r = shard.shape[1]
        else:  # column targets split A's rank dim over TP; row targets split its input dim
            r = shard.shape[0] if row_target else shard.shape[0] * tp
        found.setdefault(r, shard.name)
    if len(found) > 1:
        (r0, a), (r1, b) = list(found.items())[:2]
        raise PlanError(f"LoRA adapter parameters {a!r} (rank {r0}) and {b!r} (rank {r1}) differ")
    return next(iter(found), None)


def plan_adapter(
    shards: Iterable[ShardMeta],
    table: NameTable,
    dims: ModelDims,
    tp_size: int,
    export: LoraExport | None,
    dtype: str | None,
) -> AdapterPlan | None:
    """Plan the adapter carried by ``shards`` (its adapter shards only); None when none.

    Raises:
        PlanError: adapter shards but no ``export`` settings, an adapter parameter with no
            rule or in a layer without its base weight, inconsistent ranks or targets.
    """
    adapters = [(s, *_parse(s)) for s in shards if is_adapter(s.name)]
    if not adapters and export is None:
        return None
    if export is None:
        raise PlanError(
            f"Megatron parameter {adapters[0][0].name!r} is a LoRA adapter weight; pass "
            "lora=LoraExport(name=..., alpha=...) to export the adapter"
        )
    targets = export.targets or tuple(k for k in TARGETS if any(a[1] == k for a in adapters))
    r = _infer_rank(adapters, table, dims, tp_size)
    if export.rank is not None and r is not None and r != export.rank:
        raise PlanError(f"LoRA adapter shards have rank {r}, but LoraExport.rank={export.rank}")
    r = export.rank or r
    if r is None or not targets:
        raise PlanError(
            f"LoRA adapter {export.name!r}: this rank holds no adapter shards; give "
            "LoraExport.rank and .targets"
        )
    mappings: dict[str, ParamMapping] = {}
    for shard, kind, which in adapters:
        base = None
        if kind in targets and shard.layer is not None and 0 <= shard.layer < dims.num_layers:
            base = _base_mapping(table, dims, TARGETS[kind], shard.layer)
        if base is None:
            raise PlanError(
                f"LoRA adapter parameter {shard.name!r} (global layer {shard.layer}) has no HF "
                f"counterpart: its target is not in {list(targets)} or the HF {dims.model_type} "
                "layer has no such dense weight"
            )
        a_rule, b_rule = adapter_rules(base.rule, r, shard.name)
        rule = a_rule if which == "linear_in" else b_rule
        mappings[shard.key] = ParamMapping((shard.name,), rule)
    wire = export.dtype or dtype or _adapter_dtype(adapters)
    specs = _specs(table, dims, targets, r, wire)
    return AdapterPlan(specs, mappings, _adapter_spec(export, r, specs))


def _adapter_dtype(adapters: Sequence[tuple[ShardMeta, str, str]]) -> str:
    dtypes = {s.dtype for s, _, _ in adapters}
    if len(dtypes) != 1:
        raise PlanError(f"LoRA adapter shards mix dtypes {sorted(dtypes)}; pass LoraExport.dtype")
    return dtypes.pop()


def _specs(
    table: NameTable, dims: ModelDims, targets: Sequence[str], r: int, dtype: str
) -> tuple[TensorSpec, ...]:
    specs: list[TensorSpec] = []
    for layer in range(dims.num_layers):
        for kind, path in TARGETS.items():
            base = _base_mapping(table, dims, path, layer) if kind in targets else None
            if base is None:
                continue
            a_rule, b_rule = adapter_rules(base.rule, r, path)
            # One (lora_A, lora_B) pair per HF module, A first: PEFT's own state-dict order.
            pairs = zip(a_rule.hf, a_rule.shapes, b_rule.hf, b_rule.shapes, strict=True)
            for a_name, a_shape, b_name, b_shape in pairs:
                for template, shape in ((a_name, a_shape), (b_name, b_shape)):
                    specs.append(TensorSpec(template.format(layer=layer), dtype, dims.shape(shape)))
    return tuple(specs)


def _adapter_spec(export: LoraExport, r: int, specs: Sequence[TensorSpec]) -> LoraAdapterSpec:
    modules = sorted({s.name.rsplit(".", 3)[1] for s in specs})  # "<module>.lora_X.weight"
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": export.alpha,
        "target_modules": modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": export.base_model_name_or_path,
    }
    return LoraAdapterSpec(export.name, json.dumps(config), tuple(s.name for s in specs))
