"""Pure planning: one rank's Megatron shards -> the HF manifest and this rank's copy pieces.

``plan_rank`` runs once per layout on every trainer rank (or in the sender, from the rank's
metadata); the result is reused for every version. The plans of all ranks together are checked
and shared out over hosts in :mod:`.coverage`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch

from weightsync.buckets import TensorSpec
from weightsync.dtypes import dtype_name
from weightsync.errors import PlanError
from weightsync.manifest import LoraAdapterSpec

from .dims import ModelDims
from .lora_export import LoraExport, plan_adapter
from .name_mapping import ParamMapping
from .name_table import NameTable, name_table, template_of
from .pieces import CopyPiece
from .rules import DroppedRule, ShardContext
from .shards import RankTopology, ShardMeta


@dataclass(frozen=True, eq=False)
class RankPlan:
    """What one rank contributes to every version with this layout."""

    topology: RankTopology
    manifest: tuple[TensorSpec, ...]
    """Every HF tensor, identical on every rank, in a deterministic order."""
    pieces: Mapping[str, tuple[CopyPiece, ...]]
    """HF name -> the pieces this rank writes (only tensors it writes any byte of)."""
    shards: Mapping[str, ShardMeta]
    """The rank's shards by key (what :func:`pack_pieces` reads)."""
    lora: LoraAdapterSpec | None = None
    """The LoRA adapter whose tensors close the manifest (see ``lora_export.py``); None without
    one."""
    replica_of: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """HF name -> the data-parallel replica (``dp_rank``, for experts ``edp_rank``) this rank's
    pieces of it belong to; planned with ``every_replica``, else empty (replica 0 writes)."""
    copies: Mapping[str, tuple[CopyPiece, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    """HF name -> pieces of tensors another rank of this rank's TP group writes and this rank
    holds an equal copy of (norms, routers, row-parallel biases on TP ranks > 0; Megatron keeps
    them equal and checkpoints TP rank 0's); planned with ``every_replica``. Offered so a
    receiver on this GPU reads them here; never packed, never counted in coverage."""

    def pieces_for(self, name: str) -> tuple[CopyPiece, ...]:
        return self.pieces.get(name, ())


def hf_dims(hf_config: object) -> ModelDims:
    """The :class:`ModelDims` of a transformers ``PretrainedConfig``."""
    return name_table(_model_type(hf_config)).arch.read_dims(hf_config)


def _model_type(hf_config: object) -> str:
    model_type = getattr(hf_config, "model_type", None)
    if not model_type:
        raise PlanError(f"hf_config {type(hf_config).__name__} has no model_type")
    return model_type


def hf_manifest(hf_config: object, dtype: torch.dtype | str) -> tuple[TensorSpec, ...]:
    """Every HF tensor of the model ``hf_config`` describes, for model dtype ``dtype``."""
    table = name_table(_model_type(hf_config))
    return _manifest(table, table.arch.read_dims(hf_config), _wire(dtype))


def _wire(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else dtype_name(dtype)


def _manifest(table: NameTable, dims: ModelDims, dtype: str) -> tuple[TensorSpec, ...]:
    specs: list[TensorSpec] = []

    def emit(mapping: ParamMapping, layer: int | None) -> None:
        rule = mapping.rule
        if not rule.in_manifest or not dims.holds(mapping.when, layer):
            return
        experts: Iterable[int | None] = range(dims.num_experts) if mapping.is_expert else (None,)
        for expert in experts:
            for template, shape in zip(rule.hf, rule.shapes, strict=True):
                name = dims.hf_name(template, layer, expert)
                specs.append(TensorSpec(name, rule.dtype or dtype, dims.shape(shape)))

    arch = table.arch
    for mapping in arch.pre:
        emit(mapping, None)
    for layer in range(dims.num_layers + dims.num_mtp_layers):
        for mapping in arch.layer + (arch.mtp if layer >= dims.num_layers else ()):
            emit(mapping, layer)
    for mapping in arch.post:
        emit(mapping, None)
    return tuple(specs)


def _infer_dtype(shards: Sequence[ShardMeta], fixed: set[str]) -> str:
    counts = Counter(s.dtype for s in shards if s.key not in fixed)
    if len(counts) != 1:
        found = ", ".join(f"{d} ({n} params)" for d, n in counts.items()) or "no parameters"
        raise PlanError(
            f"cannot infer the model dtype from this rank's shards ({found}); pass dtype="
        )
    return next(iter(counts))


def plan_rank(
    shards: Sequence[ShardMeta],
    topology: RankTopology,
    hf_config: object,
    *,
    dtype: torch.dtype | str | None = None,
    tied_embeddings: bool | None = None,
    export_mtp: bool = True,
    lora: LoraExport | None = None,
    every_replica: bool = False,
) -> RankPlan:
    """Plan one rank: the full HF manifest and the pieces this rank writes.

    Args:
        shards: the rank's shard metadata (:func:`collect_shards` ``.shards``).
        topology: the rank's coordinates.
        hf_config: the target model's transformers config (``model_type`` picks the names).
        dtype: the model dtype of the HF tensors; inferred from the shards when None. Tensors
            with a fixed dtype (the router's expert bias: float32) keep theirs.
        tied_embeddings: Megatron's ``share_embeddings_and_output_weights``; checked against
            the HF config's ``tie_word_embeddings`` when given.
        export_mtp: send multi-token-prediction layers (``mtp.layers.*``) under the names
            engines load draft layers from; False drops them from the shards and the manifest.
        lora: how to export the Megatron-Bridge LoRA adapter the shards carry (PEFT names
            and config, :class:`LoraAdapterSpec` in :attr:`RankPlan.lora`); required when any
            shard is an adapter weight.
        every_replica: every data-parallel replica plans pieces (in ``replica_of``), not only
            replica 0; :func:`~.coverage.plan_hosts` then picks one replica per tensor.

    Raises:
        PlanError: naming the Megatron parameter that has no rule, no HF counterpart in this
            config, or a shape the config contradicts.
    """
    table = name_table(_model_type(hf_config))
    dims = table.arch.read_dims(hf_config)
    if not export_mtp:
        shards = [s for s in shards if not s.name.startswith("mtp.")]
        dims = _without_mtp(dims)
    if tied_embeddings is not None and tied_embeddings != dims.tied:
        raise PlanError(
            f"Megatron share_embeddings_and_output_weights={tied_embeddings} but the HF config "
            f"has tie_word_embeddings={dims.tied}; make them agree"
        )
    by_key: dict[str, ShardMeta] = {}
    for shard in shards:
        if shard.key in by_key:
            raise PlanError(
                f"Megatron parameter {shard.name!r} is registered twice in chunk {shard.vpp_chunk}"
            )
        by_key[shard.key] = shard
    # Adapter shards get their own mappings (rules sized by the LoRA rank); without adapters
    # and without `lora`, this is None and the plan is exactly the adapter-free one.
    adapter = plan_adapter(shards, table, dims, topology.tp_size, lora, _wire_or_none(dtype))
    adapter_keys = adapter.mappings.keys() if adapter else frozenset()
    mappings = {s.key: _mapping(table, dims, s) for s in shards if s.key not in adapter_keys}
    fixed = {
        k
        for k, m in mappings.items()
        if m.rule.dtype is not None or isinstance(m.rule, DroppedRule)
    }
    base = [s for s in shards if s.key not in adapter_keys]
    wire = _wire(dtype) if dtype is not None else _infer_dtype(base, fixed)
    manifest = _manifest(table, dims, wire)
    if adapter is not None:
        mappings.update(adapter.mappings)
        manifest += adapter.specs
    known = {spec.name for spec in manifest}
    pieces: dict[str, list[CopyPiece]] = {}
    copies: dict[str, list[CopyPiece]] = {}
    replica_of: dict[str, int] = {}
    for shard in shards:
        mapping = mappings[shard.key]
        if isinstance(mapping.rule, DroppedRule):
            continue
        ctx, writes, tp_copy, replica = _context(mapping, shard, topology, dims)
        writes = writes and (every_replica or replica == 0)
        for name, piece in mapping.rule.place(ctx):
            if name not in known:
                raise PlanError(
                    f"Megatron parameter {shard.name!r} maps to {name!r}, which the HF "
                    f"{dims.model_type} config does not have (layer or expert out of range?)"
                )
            if writes:
                pieces.setdefault(name, []).append(piece)
                if every_replica:
                    replica_of[name] = replica
            elif tp_copy and every_replica:
                copies.setdefault(name, []).append(piece)
    return RankPlan(
        topology,
        manifest,
        _frozen(pieces),
        MappingProxyType(by_key),
        adapter.spec if adapter else None,
        MappingProxyType(replica_of),
        _frozen({n: ps for n, ps in copies.items() if n not in pieces}),
    )


def _frozen(pieces: Mapping[str, Sequence[CopyPiece]]) -> Mapping[str, tuple[CopyPiece, ...]]:
    return MappingProxyType({name: tuple(ps) for name, ps in pieces.items()})


def _wire_or_none(dtype: torch.dtype | str | None) -> str | None:
    return None if dtype is None else _wire(dtype)


def _without_mtp(dims: ModelDims) -> ModelDims:
    moe = frozenset(i for i in dims.moe_layers if i < dims.num_layers)
    return replace(dims, num_mtp_layers=0, moe_layers=moe)


def _mapping(table: NameTable, dims: ModelDims, shard: ShardMeta) -> ParamMapping:
    template, _ = template_of(shard.name)
    if "{layer}" in template:
        if shard.layer is None:
            raise PlanError(f"Megatron parameter {shard.name!r} has no global layer index")
        first, stop = 0, dims.num_layers
        if template.startswith("mtp."):
            first, stop = dims.num_layers, dims.num_layers + dims.num_mtp_layers
            if not table.arch.mtp or not dims.num_mtp_layers:
                raise PlanError(
                    f"Megatron parameter {shard.name!r} belongs to an MTP layer, but the HF "
                    f"{dims.model_type} config has no MTP layers; pass export_mtp=False to skip "
                    "them"
                )
        if not first <= shard.layer < stop:
            raise PlanError(
                f"Megatron parameter {shard.name!r} is in global layer {shard.layer}, but the HF "
                f"config has layers {first}..{stop - 1} of that kind "
                f"(num_hidden_layers={dims.num_layers}, MTP layers={dims.num_mtp_layers})"
            )
    return table.lookup(shard.name, dims, shard.layer)


def _context(
    mapping: ParamMapping, shard: ShardMeta, topo: RankTopology, dims: ModelDims
) -> tuple[ShardContext, bool, bool, int]:
    """The rule's context for ``shard``, whether this rank writes it within its data-parallel
    replica, whether it holds an equal copy another rank of its TP group writes, and that
    replica."""
    rule = mapping.rule
    if shard.partition_dim != rule.partition_dim and (
        shard.partition_dim is not None or rule.partition_dim is None
    ):
        raise PlanError(
            f"Megatron parameter {shard.name!r} has partition_dim={shard.partition_dim}, but its "
            f"rule ({type(rule).__name__}) expects {rule.partition_dim}"
        )
    if not mapping.is_expert:
        ctx = ShardContext(shard, dims, topo.tp_rank, topo.tp_size, shard.layer)
        first_stage = topo.pp_rank == 0 and shard.vpp_chunk == 0
        held = first_stage or not rule.first_stage_only
        copy = rule.replicated and topo.tp_rank != 0
        return ctx, held and not copy, held and copy, topo.dp_rank
    if dims.num_experts % topo.ep_size:
        raise PlanError(
            f"Megatron parameter {shard.name!r}: {dims.num_experts} experts do not split over "
            f"expert-parallel size {topo.ep_size}"
        )
    local = dims.num_experts // topo.ep_size
    experts = tuple(topo.ep_rank * local + j for j in range(local))
    _, index = template_of(shard.name)
    if index is not None and index >= local:
        raise PlanError(
            f"Megatron parameter {shard.name!r} is local expert {index}, but {dims.num_experts} "
            f"experts over EP={topo.ep_size} leave {local} per rank"
        )
    expert = None if index is None else experts[index]
    ctx = ShardContext(shard, dims, topo.etp_rank, topo.etp_size, shard.layer, experts, expert)
    copy = rule.replicated and topo.etp_rank != 0
    return ctx, not copy, copy, topo.edp_rank
