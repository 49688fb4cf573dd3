"""One frozen rule per Megatron module kind: where a local shard's bytes land in HF tensors.

A rule knows the HF tensors it produces (name templates with ``{layer}`` / ``{expert}`` and
symbolic shapes, see :meth:`ModelDims.size`), the Megatron partition dim it expects, and how a
shard held by TP rank ``rank`` of ``size`` splits into :class:`CopyPiece` s. Rules never look
at process groups: the planner passes the rank and size of the group the parameter is split
over (tensor parallel for dense params, expert-tensor parallel for experts).

Megatron layouts encoded here (megatron-core 0.16.1):

- ``linear_qkv`` (column parallel): global rows are ``ng`` groups of
  ``[q (np/ng)*hn | k hn | v hn]`` with ``hn = kv_channels``; TP rank r holds the contiguous
  global rows ``[r*n, (r+1)*n)``. With ``ng >= TP`` that is whole groups; with ``ng < TP``
  (megatron all-gathers and re-slices in forward) a rank holds part of one group. Both are
  handled by intersecting the rank's row range with the q/k/v segments.
- ``linear_fc1`` with a gated linear unit: rank r holds ``[gate_r; up_r]`` (megatron uses
  ``partition_stride=2``); a plain concat of ranks would interleave gate and up.
- Row parallel (``linear_proj``, ``linear_fc2``): split on dim 1; their biases are replicated.
- Vocab (``word_embeddings``, ``output_layer``): rows split on dim 0 over the padded vocab;
  rows past the HF vocab size are padding and are not sent.
- Legacy ``GroupedMLP`` (``moe_grouped_gemm`` without TE): ``weight1`` is ``[H, E_l * X]``
  whose memory is ``E_l`` blocks of ``[H, X]`` (``X`` = this rank's ``[gate_r | up_r]``
  columns), ``weight2`` is ``E_l`` blocks of ``[F/etp, H]``; each expert block is the
  transpose of the HF weight (see ``GroupedMLP.forward``: ``weight1.view(E_l, H, -1)``).
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.errors import PlanError

from .dims import ModelDims
from .pieces import CopyPiece
from .shards import ShardMeta

Shape = tuple[int | str, ...]
"""Symbolic shape: ints or :meth:`ModelDims.size` symbols."""


@dataclass(frozen=True)
class ShardContext:
    """What a rule needs to place one shard."""

    shard: ShardMeta
    dims: ModelDims
    rank: int
    """Rank in the group this parameter is split over (tp, or etp for experts)."""
    size: int
    layer: int | None = None
    """Global layer index."""
    experts: tuple[int, ...] = ()
    """Global index of every local expert of this layer (for layouts holding all of them)."""
    expert: int | None = None
    """Global expert index of this shard (per-expert layouts)."""

    def hf_name(self, template: str, expert: int | None = None) -> str:
        return self.dims.hf_name(template, self.layer, self.expert if expert is None else expert)

    def expect_shape(self, shape: tuple[int, ...], why: str) -> None:
        if self.shard.shape != shape:
            raise PlanError(
                f"Megatron parameter {self.shard.name!r} has shape {self.shard.shape}, but the HF "
                f"config ({self.dims.model_type}) implies {shape} ({why}); does the HF config "
                "match the trained model?"
            )

    def split(self, total: int, what: str) -> int:
        if total % self.size:
            raise PlanError(
                f"Megatron parameter {self.shard.name!r}: {what}={total} is not divisible by the "
                f"parallel size {self.size}"
            )
        return total // self.size


Placed = list[tuple[str, CopyPiece]]


@dataclass(frozen=True)
class Rule:
    """Base: ``hf`` templates, their symbolic ``shapes``, the expected ``partition_dim``."""

    hf: tuple[str, ...]
    shapes: tuple[Shape, ...]
    partition_dim: int | None = None
    """Megatron's partition dim for this kind; None for replicated params."""
    dtype: str | None = None
    """Wire dtype of the HF tensors when fixed (e.g. ``"float32"``); None: the model dtype."""
    in_manifest: bool = True
    """False for an alternative layout of tensors that another mapping announces."""
    first_stage_only: bool = False
    """Only the first pipeline stage (pp rank 0, chunk 0) writes it; later stages hold
    synchronized replicas (megatron's word embeddings on the MTP / tied-output stage)."""

    def __post_init__(self) -> None:
        if len(self.hf) != len(self.shapes):
            raise PlanError(
                f"{type(self).__name__}: {len(self.hf)} HF names, {len(self.shapes)} shapes"
            )

    @property
    def replicated(self) -> bool:
        """Replicated across its TP group: only group rank 0 writes."""
        return self.partition_dim is None

    def place(self, ctx: ShardContext) -> Placed:
        raise NotImplementedError


@dataclass(frozen=True)
class ReplicatedRule(Rule):
    """Norms, router, q/k layernorm, row-parallel biases, shared-expert gate: one full copy."""

    def place(self, ctx: ShardContext) -> Placed:
        ctx.expect_shape(ctx.dims.shape(self.shapes[0]), "replicated")
        return [(ctx.hf_name(self.hf[0]), CopyPiece(ctx.shard.key))]


@dataclass(frozen=True)
class ColumnRule(Rule):
    """Column parallel without gating (non-gated ``linear_fc1`` and its bias): dim 0 split."""

    partition_dim: int | None = 0

    def place(self, ctx: ShardContext) -> Placed:
        full = ctx.dims.shape(self.shapes[0])
        n = ctx.split(full[0], "rows")
        ctx.expect_shape((n, *full[1:]), f"{full[0]} rows split {ctx.size} ways")
        return [(ctx.hf_name(self.hf[0]), CopyPiece(ctx.shard.key, dst=((0, ctx.rank * n, n),)))]


@dataclass(frozen=True)
class LatentDownRule(ColumnRule):
    """MLA's ``linear_q_down_proj`` / ``linear_kv_down_proj``: column parallel in the local spec
    (``ColumnParallelLinear``, its output gathered), replicated in the TE spec
    (``TELinear(parallel_mode="duplicated")``) under the same name; a replicated shard is
    written whole, by TP rank 0 only."""

    def place(self, ctx: ShardContext) -> Placed:
        if ctx.shard.partition_dim is not None:
            return super().place(ctx)
        ctx.expect_shape(ctx.dims.shape(self.shapes[0]), "replicated (TE spec)")
        return [] if ctx.rank else [(ctx.hf_name(self.hf[0]), CopyPiece(ctx.shard.key))]


@dataclass(frozen=True)
class RowRule(Rule):
    """Row parallel (``linear_proj``, ``linear_fc2``, expert fc2): dim 1 split."""

    partition_dim: int | None = 1

    def place(self, ctx: ShardContext) -> Placed:
        rows, cols = ctx.dims.shape(self.shapes[0])
        n = ctx.split(cols, "columns")
        ctx.expect_shape((rows, n), f"{cols} columns split {ctx.size} ways")
        return [(ctx.hf_name(self.hf[0]), CopyPiece(ctx.shard.key, dst=((1, ctx.rank * n, n),)))]


@dataclass(frozen=True)
class VocabRule(Rule):
    """Embedding / output layer: dim 0 over the padded vocab, padding rows trimmed."""

    shapes: tuple[Shape, ...] = (("vocab", "hidden"),)
    partition_dim: int | None = 0

    def place(self, ctx: ShardContext) -> Placed:
        vocab, hidden = ctx.dims.shape(self.shapes[0])
        n = ctx.shard.shape[0]
        if len(ctx.shard.shape) != 2 or ctx.shard.shape[1] != hidden or n * ctx.size < vocab:
            raise PlanError(
                f"Megatron parameter {ctx.shard.name!r} has shape {ctx.shard.shape}; with "
                f"{ctx.size} vocab shards the HF config ({ctx.dims.model_type}) needs "
                f"(>= {-(-vocab // ctx.size)}, {hidden}) to hold vocab_size={vocab}"
            )
        start = ctx.rank * n
        length = min(n, vocab - start)
        if length <= 0:
            return []
        src = ((0, 0, length),) if length < n else ()
        return [(ctx.hf_name(self.hf[0]), CopyPiece(ctx.shard.key, src, ((0, start, length),)))]


@dataclass(frozen=True)
class QKVRule(Rule):
    """``linear_qkv`` weight or bias -> q, k, v (see the module docstring for the layout).

    ``output_gate`` (megatron ``attention_output_gate``, Qwen3-Next / Qwen3.5): each group is
    ``[q (np/ng)*hn | gate (np/ng)*hn | k hn | v hn]``, and HF's ``q_proj`` holds each head's
    query rows followed by its gate rows (``view(..., heads, 2 * head_dim)`` then ``chunk``)."""

    partition_dim: int | None = 0
    output_gate: bool = False

    def place(self, ctx: ShardContext) -> Placed:
        dims = ctx.dims
        rest = dims.shape(self.shapes[0])[1:]
        hn, groups = dims.head_dim, dims.num_kv_heads
        q_per_group = dims.num_heads // groups
        q_rows = (2 if self.output_gate else 1) * q_per_group * hn
        group_rows = q_rows + 2 * hn
        n = ctx.split(groups * group_rows, "q+k+v rows")
        ctx.expect_shape(
            (n, *rest),
            f"{dims.num_heads} heads, {groups} query groups, head_dim {hn}, split {ctx.size} ways",
        )
        lo, hi = ctx.rank * n, (ctx.rank + 1) * n
        placed: Placed = []
        for g in range(groups):
            base = g * group_rows
            if self.output_gate:
                heads = range(g * q_per_group, (g + 1) * q_per_group)
                segments = [(0, base + i * hn, hn, h * 2 * hn) for i, h in enumerate(heads)]
                segments += [
                    (0, base + (q_per_group + i) * hn, hn, (h * 2 + 1) * hn)
                    for i, h in enumerate(heads)
                ]
            else:
                segments = [(0, base, q_rows, g * q_rows)]
            segments += [(1, base + q_rows, hn, g * hn), (2, base + q_rows + hn, hn, g * hn)]
            for which, seg_start, seg_len, dst_start in segments:
                a, b = max(lo, seg_start), min(hi, seg_start + seg_len)
                if a < b:
                    piece = CopyPiece(
                        ctx.shard.key,
                        ((0, a - lo, b - a),),
                        ((0, dst_start + a - seg_start, b - a),),
                    )
                    placed.append((ctx.hf_name(self.hf[which]), piece))
        return placed


@dataclass(frozen=True)
class HeadSectionsRule(Rule):
    """A gated delta net's ``in_proj`` / ``conv1d`` (megatron ``GatedDeltaNet``): sections
    ``[q | k | v | z | beta | alpha]`` (``conv1d``: ``[q | k | v]``), each split over TP by
    whole key heads, so rank r holds ``[q_r; k_r; v_r; ...]`` (see ``GatedDeltaNet.forward``).

    ``sections``: per section, the size symbol of its rows per key head and the index of the
    HF tensor it lands in. ``interleaved`` (Qwen3-Next ``in_proj_qkvz`` / ``in_proj_ba``): the
    HF tensor holds one block per key head, its sections in order
    (``fix_query_key_value_ordering``); otherwise (``conv1d``, Qwen3.5 ``in_proj_qkv``) each
    section is contiguous over all heads, sections one after another.
    """

    partition_dim: int | None = 0
    sections: tuple[tuple[str, int], ...] = ()
    interleaved: bool = False

    def place(self, ctx: ShardContext) -> Placed:
        dims = ctx.dims
        heads = dims.linear_k_heads
        local = ctx.split(heads, "linear-attention key heads")
        units = [dims.size(unit) for unit, _ in self.sections]
        rest = dims.shape(self.shapes[0])[1:]
        ctx.expect_shape(
            (local * sum(units), *rest),
            f"{heads} key heads split {ctx.size} ways, {sum(units)} rows per head",
        )
        placed: Placed = []
        src = 0
        for s, (unit, (_, which)) in enumerate(zip(units, self.sections, strict=True)):
            mine = [u if w == which else 0 for u, (_, w) in zip(units, self.sections, strict=True)]
            before, block = sum(mine[:s]), sum(mine)  # rows of this HF tensor's earlier sections
            for j in range(local):
                head = ctx.rank * local + j
                if self.interleaved:
                    dst = head * block + before
                else:
                    dst = heads * before + head * unit
                piece = CopyPiece(ctx.shard.key, ((0, src, unit),), ((0, dst, unit),))
                placed.append((ctx.hf_name(self.hf[which]), piece))
                src += unit
        return placed


@dataclass(frozen=True)
class GatedFc1Rule(Rule):
    """Gated ``linear_fc1`` (weight or bias): rank r holds ``[gate_r; up_r]``."""

    partition_dim: int | None = 0

    def place(self, ctx: ShardContext) -> Placed:
        full = ctx.dims.shape(self.shapes[0])
        n = ctx.split(full[0], "gate rows")
        ctx.expect_shape((2 * n, *full[1:]), f"gate+up of {full[0]} rows split {ctx.size} ways")
        dst = ((0, ctx.rank * n, n),)
        return [
            (ctx.hf_name(self.hf[0]), CopyPiece(ctx.shard.key, ((0, 0, n),), dst)),
            (ctx.hf_name(self.hf[1]), CopyPiece(ctx.shard.key, ((0, n, n),), dst)),
        ]


@dataclass(frozen=True)
class GroupedFc1Rule(Rule):
    """Legacy ``GroupedMLP.weight1`` ``[H, E_l * X]``: every local expert's gate (and up)."""

    partition_dim: int | None = 1
    in_manifest: bool = False

    def place(self, ctx: ShardContext) -> Placed:
        ffn, hidden = ctx.dims.shape(self.shapes[0])
        n = ctx.split(ffn, "expert ffn")
        local, width = len(ctx.experts), n * len(self.hf)
        ctx.expect_shape(
            (hidden, local * width), f"{local} local experts, fc1 split {ctx.size} ways"
        )
        placed: Placed = []
        for j, expert in enumerate(ctx.experts):
            for k, template in enumerate(self.hf):
                piece = CopyPiece(
                    ctx.shard.key,
                    src=((0, j, 1), (1, k * n, n)),
                    dst=((0, ctx.rank * n, n),),
                    src_view=(local, hidden, width),
                    src_transpose=(1, 2),
                )
                placed.append((ctx.hf_name(template, expert), piece))
        return placed


@dataclass(frozen=True)
class GroupedFc2Rule(Rule):
    """Legacy ``GroupedMLP.weight2`` ``[E_l * F/etp, H]``: every local expert's down proj."""

    partition_dim: int | None = 0
    in_manifest: bool = False

    def place(self, ctx: ShardContext) -> Placed:
        hidden, ffn = ctx.dims.shape(self.shapes[0])
        n = ctx.split(ffn, "expert ffn")
        local = len(ctx.experts)
        ctx.expect_shape((local * n, hidden), f"{local} local experts, fc2 split {ctx.size} ways")
        return [
            (
                ctx.hf_name(self.hf[0], expert),
                CopyPiece(
                    ctx.shard.key,
                    src=((0, j, 1),),
                    dst=((1, ctx.rank * n, n),),
                    src_view=(local, n, hidden),
                    src_transpose=(1, 2),
                ),
            )
            for j, expert in enumerate(ctx.experts)
        ]


@dataclass(frozen=True)
class DroppedRule(Rule):
    """A Megatron tensor deliberately not sent (the reason is part of the table)."""

    hf: tuple[str, ...] = ()
    shapes: tuple[Shape, ...] = ()
    reason: str = ""
    in_manifest: bool = False

    def place(self, ctx: ShardContext) -> Placed:
        return []
