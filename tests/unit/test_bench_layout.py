"""The bench's synthetic model shapes and trainer layouts (pure planning, CPU tensors)."""

from __future__ import annotations

import pytest
import torch

from weightsync.app.bench.layout import TrainerShards, plan_layout
from weightsync.app.bench.models import hf_specs, model_shape
from weightsync.buckets import ChunkAssembler, plan_buckets, unpack_bucket
from weightsync.errors import ConfigError, PlanError


def test_qwen25_7b_has_the_real_tensor_count_and_size():
    specs = hf_specs(model_shape("qwen2.5-7b"))
    assert len(specs) == 339
    assert sum(s.nbytes for s in specs) == 15_231_233_024
    assert {s.dtype for s in specs} == {"bfloat16"}
    assert "model.layers.27.self_attn.k_proj.bias" in {s.name for s in specs}


def test_qwen3_moe_is_cut_by_default_and_says_so():
    shape = model_shape("qwen3-30b-a3b")
    assert (shape.layers, shape.full_layers) == (12, 48)
    names = {s.name for s in hf_specs(shape)}
    assert "model.layers.11.mlp.experts.127.down_proj.weight" in names
    assert "model.layers.12.input_layernorm.weight" not in names
    assert model_shape("qwen3-30b-a3b", 48).full_layers == 0
    with pytest.raises(ConfigError, match="pick 1..48"):
        model_shape("qwen3-30b-a3b", 49)


@pytest.mark.parametrize("model", ["qwen2.5-7b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("tp", [1, 2])
def test_pieces_tile_every_hf_tensor_and_read_every_shard_byte_once(model, tp):
    layout = plan_layout(model_shape(model), tp)
    read: dict[str, int] = {}
    for recipe in layout.recipes:
        cells = 0
        boxes = []
        for p in recipe.pieces:
            assert p.dst_row + p.rows <= recipe.rows and p.dst_col + p.cols <= recipe.cols
            for b in boxes:  # no two pieces write the same cell
                rows_apart = p.dst_row >= b.dst_row + b.rows or b.dst_row >= p.dst_row + p.rows
                cols_apart = p.dst_col >= b.dst_col + b.cols or b.dst_col >= p.dst_col + p.cols
                assert rows_apart or cols_apart, recipe.spec.name
            boxes.append(p)
            cells += p.rows * p.cols
            read[p.shard] = read.get(p.shard, 0) + p.rows * p.cols
        assert cells == recipe.rows * recipe.cols, recipe.spec.name
    shards = {s.key: s for s in layout.shards}
    # Every shard is read exactly once, except replicas on ranks > 0 (never read).
    for key, shard in shards.items():
        assert read.get(key, 0) in ((shard.numel,) if shard.rank == 0 else (0, shard.numel))
    assert sum(read.values()) == layout.total_bytes // 2
    assert all(r.is_view for r in layout.recipes) == (tp == 1)


def _split_tp2(hf: dict[str, torch.Tensor], shards: TrainerShards) -> None:
    """Write TP=2 shards from HF tensors by the documented conventions (independently of the
    recipes): fused [q_r; k_r; v_r] and [gate_r; up_r], dim-1 row-parallel, vocab rows."""
    views = shards.views
    for r in range(2):
        for name, t in hf.items():
            prefix, _, leaf = name.rpartition(".")
            parent, _, module = prefix.rpartition(".")
            if module in ("q_proj", "k_proj", "v_proj"):
                parts = [hf[f"{parent}.{m}_proj.{leaf}"].chunk(2)[r] for m in "qkv"]
                qkv = torch.cat(parts)
                views[f"rank{r}/{parent}.qkv.{leaf}"].copy_(qkv.reshape(qkv.shape[0], -1))
            elif module in ("gate_proj", "up_proj"):
                fc1 = torch.cat(
                    [hf[f"{parent}.{m}.{leaf}"].chunk(2)[r] for m in ("gate_proj", "up_proj")]
                )
                views[f"rank{r}/{parent}.fc1"].copy_(fc1)
            elif module in ("o_proj", "down_proj"):
                views[f"rank{r}/{prefix}"].copy_(t.chunk(2, dim=1)[r])
            elif module in ("embed_tokens", "lm_head"):
                views[f"rank{r}/{prefix}"].copy_(t.chunk(2)[r])
            else:
                views[f"rank{r}/{prefix}"].copy_(t.reshape(t.shape[0], -1))


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_tp2_shards_assemble_back_to_the_hf_tensors(model):
    shape = model_shape(model)
    g = torch.Generator().manual_seed(3)
    hf = {s.name: torch.randn(s.shape, generator=g).to(torch.bfloat16) for s in hf_specs(shape)}
    layout = plan_layout(shape, 2)
    shards = TrainerShards.allocate(layout, torch.device("cpu"), seed=1)
    _split_tp2(hf, shards)
    for recipe in layout.recipes:
        assert torch.equal(shards.assemble(recipe), hf[recipe.spec.name]), recipe.spec.name


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_each_rank_offers_contiguous_pieces_of_its_own_shards_tiling_every_tensor(model):
    """What one publisher rank of the node bench offers: only its shards' pieces, each
    contiguous (receivers read them in place); the ranks' pieces together tile every tensor,
    and each rank offers its own copy of a replicated tensor, holding the same bytes."""
    layout = plan_layout(model_shape(model), 2)
    shards = TrainerShards.allocate(layout, torch.device("cpu"), seed=0)
    shards.fill(7)
    owned = [{f.untyped_storage().data_ptr()} for f in shards.flats]
    covered = {s.name: torch.zeros(s.shape, dtype=torch.int32) for s in layout.specs}
    for rank in (0, 1):
        for name, regions in shards.regions(rank).items():
            for region in regions:
                src = region.source
                assert src.is_contiguous() and {src.untyped_storage().data_ptr()} == owned[rank]
                box = tuple(
                    slice(a, a + n) for a, n in zip(region.dst_start, src.shape, strict=True)
                )
                covered[name][box] += 1
                want = shards.assemble(shards.recipes[name])[box]
                assert torch.equal(src.view(torch.int16), want.view(torch.int16))  # NaN bits
    replicated = {r.spec.name for r in layout.recipes if r.replicas}
    assert replicated and all("norm" in n or n.endswith("mlp.gate.weight") for n in replicated)
    for name, count in covered.items():
        assert bool((count == (2 if name in replicated else 1)).all()), name
    assert shards.regions().keys() == covered.keys()


@pytest.mark.parametrize("tp", [1, 2])
def test_pack_gathers_into_buckets_that_unpack_to_the_assembled_tensors(tp):
    layout = plan_layout(model_shape("tiny-moe"), tp)
    shards = TrainerShards.allocate(layout, torch.device("cpu"), seed=0)
    plan = plan_buckets(layout.specs, 64 * 1024)  # the 512 KiB embedding is chunked
    assert any(e.is_chunked for b in plan.buckets for e in b.entries)
    assembler, got = ChunkAssembler(), {}
    for bucket in plan.buckets:
        buffer = torch.full((plan.bucket_size_bytes,), 0xAB, dtype=torch.uint8)
        shards.pack(bucket, buffer)
        got.update((n, t.clone()) for n, t in unpack_bucket(buffer, bucket, assembler))
    assert set(got) == {r.spec.name for r in layout.recipes}
    for recipe in layout.recipes:
        assert torch.equal(got[recipe.spec.name], shards.assemble(recipe)), recipe.spec.name


def test_pack_refuses_a_chunk_that_is_not_whole_rows():
    layout = plan_layout(model_shape("tiny"), 2)
    shards = TrainerShards.allocate(layout, torch.device("cpu"), seed=0)
    plan = plan_buckets(layout.specs, 256)  # down_proj rows are 512 bytes: byte chunks
    bucket = next(b for b in plan.buckets if b.entries[0].spec.row_bytes > 256)
    with pytest.raises(PlanError, match="not whole rows"):
        shards.pack(bucket, torch.empty(plan.bucket_size_bytes, dtype=torch.uint8))


def test_step_changes_every_element_and_keeps_it_finite():
    shards = TrainerShards.allocate(plan_layout(model_shape("tiny"), 1), torch.device("cpu"), 0)
    before = [f.clone() for f in shards.flats]
    shards.step()
    for old, new in zip(before, shards.flats, strict=True):
        assert not (old.view(torch.int16) == new.view(torch.int16)).any()
        assert torch.isfinite(new.float()).all() and (new != 0).all()


def test_views_exist_only_where_the_hf_tensor_is_one_shard_slice():
    shards = TrainerShards.allocate(plan_layout(model_shape("tiny"), 2), torch.device("cpu"), 0)
    q = next(r for r in shards.layout.recipes if r.spec.name.endswith("q_proj.weight"))
    with pytest.raises(PlanError, match="needs a gather"):
        shards.hf_view(q)
    one = TrainerShards.allocate(plan_layout(model_shape("tiny"), 1), torch.device("cpu"), 0)
    view = one.hf_views()["model.layers.0.self_attn.k_proj.weight"]
    assert view.untyped_storage().data_ptr() == one.flats[0].untyped_storage().data_ptr()
