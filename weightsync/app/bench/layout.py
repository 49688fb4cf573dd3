"""Synthetic trainer layouts: TP shards and, per HF tensor, the pieces that assemble it.

Pure planning plus two small shells (allocating shards, copying pieces). Deliberately simpler
than Megatron (``sender/megatron/`` holds the real rules) and independent of it:

- every rank's shards are views into one flat bf16 buffer per rank, as Megatron's
  distributed-optimizer parameter buffers are (so CUDA IPC needs one handle per rank);
- fused QKV per rank is ``[q_r; k_r; v_r]`` (no per-group interleave), fused fc1 per rank is
  ``[gate_r; up_r]``: HF q/k/v and gate/up are row gathers across ranks;
- row-parallel weights (o_proj, down_proj, expert down_proj) split on dim 1;
- embedding and lm_head split on vocab rows; norms, q/k norms and the router are replicated
  (every rank holds a copy; the HF tensor is read from rank 0's).

With TP=1 every HF tensor is a contiguous row range of one shard, i.e. a view; with TP=2 most
HF tensors are several pieces, each contiguous: receivers read them in place (direct) or the
sender gathers them into buckets (staged).

Every tensor is viewed as 2-D ``[shape[0], prod(shape[1:])]`` (1-D tensors as ``[n, 1]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from weightsync.app.bench.models import ModelShape, hf_specs
from weightsync.buckets import Bucket, TensorSpec
from weightsync.errors import ConfigError, PlanError
from weightsync.regions import Region

_ALIGN_ELEMS = 128
"""Shard offsets in the flat buffer are 256-byte aligned, like the CUDA caching allocator's."""


@dataclass(frozen=True)
class ShardSpec:
    """One trainer parameter shard, 2-D, at ``offset`` elements into its rank's flat buffer."""

    key: str
    rank: int
    rows: int
    cols: int
    offset: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class Piece:
    """Shard rows ``[src_row, src_row + rows)`` (all columns) land in the HF tensor's 2-D view
    at rows ``[dst_row, dst_row + rows)``, columns ``[dst_col, dst_col + cols)``."""

    shard: str
    src_row: int
    dst_row: int
    rows: int
    dst_col: int
    cols: int


@dataclass(frozen=True)
class HfRecipe:
    spec: TensorSpec
    rows: int
    cols: int
    pieces: tuple[Piece, ...]
    replicas: tuple[str, ...] = ()
    """Other ranks' shards holding the same bytes as the one piece (a replicated norm or
    router on every TP rank but the first): each rank offers its own copy, as Megatron's
    TP ranks each hold one."""

    @property
    def is_view(self) -> bool:
        """One piece of whole rows: the HF tensor is a contiguous slice of one shard."""
        return len(self.pieces) == 1 and self.pieces[0].cols == self.cols


@dataclass(frozen=True)
class TrainerLayout:
    model: ModelShape
    tp: int
    shards: tuple[ShardSpec, ...]
    recipes: tuple[HfRecipe, ...]
    rank_numel: tuple[int, ...]
    """Elements of each rank's flat buffer (with alignment padding)."""

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        return tuple(r.spec for r in self.recipes)

    @property
    def total_bytes(self) -> int:
        return sum(r.spec.nbytes for r in self.recipes)

    @property
    def name(self) -> str:
        return f"TP={self.tp}"


def _two_d(spec: TensorSpec) -> tuple[int, int]:
    return spec.shape[0], math.prod(spec.shape[1:])


def _split(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ConfigError(f"TP={tp} does not divide {what} ({n}); pick a TP size that does")
    return n // tp


def plan_layout(model: ModelShape, tp: int) -> TrainerLayout:
    """Shards of a ``tp``-way tensor-parallel trainer and the recipe of every HF tensor."""
    if tp < 1:
        raise ConfigError(f"TP must be >= 1, got {tp}")
    shards: dict[str, ShardSpec] = {}
    used = [0] * tp

    def shard(rank: int, name: str, rows: int, cols: int) -> str:
        key = f"rank{rank}/{name}"
        if key not in shards:
            shards[key] = ShardSpec(key, rank, rows, cols, used[rank])
            used[rank] += -(-rows * cols // _ALIGN_ELEMS) * _ALIGN_ELEMS
        return key

    q, kv, ffn = model.q_rows, model.kv_rows, model.ffn_rows
    qr, kvr, fr = _split(q, tp, "q rows"), _split(kv, tp, "kv rows"), _split(ffn, tp, "ffn rows")
    recipes = []
    for spec in hf_specs(model):
        rows, cols = _two_d(spec)
        prefix, _, leaf = spec.name.rpartition(".")
        module = prefix.rpartition(".")[2]
        pieces: list[Piece] = []
        if module in ("embed_tokens", "lm_head"):
            vr = _split(rows, tp, "the vocab size")
            for r in range(tp):
                pieces.append(Piece(shard(r, prefix, vr, cols), 0, r * vr, vr, 0, cols))
        elif module in ("q_proj", "k_proj", "v_proj"):
            start = {"q_proj": 0, "k_proj": qr, "v_proj": qr + kvr}[module]
            own = qr if module == "q_proj" else kvr
            fused = prefix.rpartition(".")[0] + f".qkv.{leaf}"
            for r in range(tp):
                key = shard(r, fused, qr + 2 * kvr, cols)
                pieces.append(Piece(key, start, r * own, own, 0, cols))
        elif module in ("gate_proj", "up_proj"):
            fused = prefix.rpartition(".")[0] + ".fc1"
            for r in range(tp):
                key = shard(r, fused, 2 * fr, cols)
                pieces.append(Piece(key, 0 if module == "gate_proj" else fr, r * fr, fr, 0, cols))
        elif module in ("o_proj", "down_proj"):
            cr = _split(cols, tp, f"{spec.name} columns")
            for r in range(tp):
                pieces.append(Piece(shard(r, prefix, rows, cr), 0, 0, rows, r * cr, cr))
        else:  # norms, q/k norms, router: replicated on every rank
            keys = [shard(r, prefix, rows, cols) for r in range(tp)]
            pieces.append(Piece(keys[0], 0, 0, rows, 0, cols))
            recipes.append(HfRecipe(spec, rows, cols, tuple(pieces), tuple(keys[1:])))
            continue
        recipes.append(HfRecipe(spec, rows, cols, tuple(pieces)))
    return TrainerLayout(model, tp, tuple(shards.values()), tuple(recipes), tuple(used))


class TrainerShards:
    """A layout's shards in memory: one flat bf16 buffer per rank and a 2-D view per shard."""

    def __init__(self, layout: TrainerLayout, flats: list[torch.Tensor]) -> None:
        if [f.numel() for f in flats] != list(layout.rank_numel):
            raise PlanError(f"flat buffers of {layout.name} do not match the layout's sizes")
        self.layout = layout
        self.flats = flats
        self.recipes = {r.spec.name: r for r in layout.recipes}
        self.views = {
            s.key: flats[s.rank][s.offset : s.offset + s.numel].view(s.rows, s.cols)
            for s in layout.shards
        }
        self._rank_of = {s.key: s.rank for s in layout.shards}

    @classmethod
    def allocate(cls, layout: TrainerLayout, device: torch.device, seed: int) -> TrainerShards:
        """Random bf16 shards (normal, so never all zeros) on ``device``."""
        flats = []
        for rank, numel in enumerate(layout.rank_numel):
            g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
            flats.append(torch.randn(numel, generator=g, dtype=torch.bfloat16, device=device))
        shards = cls(layout, flats)
        shards._copy_replicas()
        return shards

    def step(self) -> None:
        """A stand-in optimizer step that changes every element: flip the lowest mantissa
        bit (stays finite, never zero-for-nonzero), so a stale receiver can never match."""
        for flat in self.flats:
            flat.view(torch.int16).bitwise_xor_(1)

    def hf_view(self, recipe: HfRecipe) -> torch.Tensor:
        """The HF tensor as a view of trainer memory (only for ``recipe.is_view``)."""
        if not recipe.is_view:
            raise PlanError(f"{recipe.spec.name!r} needs a gather in this layout, not a view")
        p = recipe.pieces[0]
        return self.views[p.shard][p.src_row : p.src_row + p.rows].view(recipe.spec.shape)

    def hf_views(self) -> dict[str, torch.Tensor]:
        return {r.spec.name: self.hf_view(r) for r in self.layout.recipes}

    def fill(self, seed: int) -> None:
        """Random bytes, the same for the same seed on any GPU (the node bench's versions)."""
        for rank, flat in enumerate(self.flats):
            g = torch.Generator(flat.device).manual_seed(seed * 1000 + rank)
            flat.view(torch.uint8).random_(0, 256, generator=g)
        self._copy_replicas()

    def _copy_replicas(self) -> None:
        """Make every replica hold its first copy's bytes (random fills differ per rank)."""
        for recipe in self.layout.recipes:
            for key in recipe.replicas:
                self.views[key].copy_(self.views[recipe.pieces[0].shard])

    def regions(self, rank: int | None = None) -> dict[str, list[Region]]:
        """Every HF tensor's pieces as views of the shards, in the HF tensor's own shape
        (what a publisher offers so the sender can gather them itself, or receivers read them
        in place); ``rank``: only that rank's (what one rank of a multi-rank trainer offers),
        its own replica of a replicated tensor included."""
        out = {}
        for recipe in self.layout.recipes:
            shape = recipe.spec.shape
            parts = []
            own = [k for k in recipe.replicas if self._rank_of[k] == rank]
            if own:
                out[recipe.spec.name] = [Region((0,) * len(shape), self.views[own[0]].view(shape))]
                continue
            for p in recipe.pieces:
                if rank is not None and self._rank_of[p.shard] != rank:
                    continue
                src = self.views[p.shard][p.src_row : p.src_row + p.rows]
                if p.cols != recipe.cols and len(shape) != 2:
                    raise PlanError(
                        f"{recipe.spec.name!r}: a column piece of a {len(shape)}-D tensor"
                    )
                if len(shape) == 2:
                    parts.append(Region((p.dst_row, p.dst_col), src))
                else:
                    start = (p.dst_row,) + (0,) * (len(shape) - 1)
                    parts.append(Region(start, src.reshape(p.rows, *shape[1:])))
            if parts:
                out[recipe.spec.name] = parts
        return out

    def assemble_rows(self, recipe: HfRecipe, dst: torch.Tensor, row0: int) -> None:
        """Fill ``dst`` (2-D, HF rows ``[row0, row0 + dst.shape[0])``) from the shards."""
        row1 = row0 + dst.shape[0]
        for p in recipe.pieces:
            lo, hi = max(row0, p.dst_row), min(row1, p.dst_row + p.rows)
            if lo >= hi:
                continue
            src = self.views[p.shard][p.src_row + lo - p.dst_row : p.src_row + hi - p.dst_row]
            dst[lo - row0 : hi - row0, p.dst_col : p.dst_col + p.cols].copy_(src, non_blocking=True)

    def assemble(self, recipe: HfRecipe, device: torch.device | None = None) -> torch.Tensor:
        """The whole HF tensor, gathered into new memory (for verification, not the hot path)."""
        out = torch.empty(
            recipe.rows, recipe.cols, dtype=recipe.spec.torch_dtype, device=device or self.device
        )
        self.assemble_rows(recipe, out, 0)
        return out.view(recipe.spec.shape)

    @property
    def device(self) -> torch.device:
        return self.flats[0].device

    def pack(self, bucket: Bucket, buffer: torch.Tensor) -> None:
        """A ``Publisher.publish_packed`` pack function: gather each entry straight into the
        bucket, reading each shard byte once and writing each bucket byte once."""
        for entry in bucket.entries:
            recipe = self.recipes[entry.name]
            row_bytes = recipe.cols * entry.spec.torch_dtype.itemsize
            if entry.tensor_offset % row_bytes or entry.nbytes % row_bytes:
                raise PlanError(
                    f"chunk of {entry.name!r} is not whole rows; use a bucket of at least "
                    f"{row_bytes} bytes"
                )
            rows = entry.nbytes // row_bytes
            dst = buffer[entry.offset : entry.offset + entry.nbytes]
            dst = dst.view(entry.spec.torch_dtype).view(rows, recipe.cols)
            self.assemble_rows(recipe, dst, entry.tensor_offset // row_bytes)
