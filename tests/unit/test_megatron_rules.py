"""Rules and pack_pieces on synthetic shards (no megatron): each layout against its definition."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from weightsync.buckets import BucketEntry, TensorSpec, plan_buckets
from weightsync.dtypes import dtype_name
from weightsync.errors import PlanError
from weightsync.sender.megatron.dims import ModelDims
from weightsync.sender.megatron.pieces import CopyPiece, pack_pieces
from weightsync.sender.megatron.rules import (
    GatedFc1Rule,
    GroupedFc1Rule,
    GroupedFc2Rule,
    QKVRule,
    ReplicatedRule,
    RowRule,
    ShardContext,
    VocabRule,
)
from weightsync.sender.megatron.shards import ShardMeta


def dims(**kw) -> ModelDims:
    base = dict(
        model_type="llama",
        num_layers=1,
        hidden=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=2,
        ffn=12,
        vocab=10,
        tied=False,
    )
    return ModelDims(**{**base, **kw})


def assemble(rule, d: ModelDims, shards: list[torch.Tensor], pdim, shapes=None, **ctx):
    """Place every rank's shard with ``rule`` and pack all pieces through one bucket.

    ``shapes``: HF name -> symbolic shape (default: the rule's own names and shapes).
    """
    shapes = shapes or dict(zip(rule.hf, rule.shapes, strict=True))
    placed = []
    for rank, tensor in enumerate(shards):
        meta = ShardMeta(f"p{rank}", 0, 0, dtype_name(tensor.dtype), tuple(tensor.shape), pdim)
        c = ShardContext(meta, d, rank, len(shards), layer=0, **ctx)
        placed += [(name, piece, {meta.key: tensor}) for name, piece in rule.place(c)]
    dtype = dtype_name(shards[0].dtype)
    specs = [TensorSpec(name, dtype, d.shape(shape)) for name, shape in shapes.items()]
    (bucket,) = plan_buckets(specs, 1 << 20).buckets
    buffer = torch.full((bucket.nbytes,), 0xFF, dtype=torch.uint8)
    for entry in bucket.entries:
        for name, piece, tensors in placed:
            if name == entry.name:
                pack_pieces(buffer, entry, [piece], tensors)
    return {
        e.name: buffer[e.offset : e.offset + e.nbytes].view(e.spec.torch_dtype).view(e.spec.shape)
        for e in bucket.entries
    }


def megatron_qkv(q, k, v, groups):
    """The TP=1 Megatron ``linear_qkv`` rows: per group ``[q heads of the group, k, v]``."""
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
        1,
    ).reshape(-1, *rest)


@settings(max_examples=60, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4, 8]),
    groups=st.sampled_from([1, 2, 4, 8]),
    q_per_group=st.integers(1, 3),
    head_dim=st.sampled_from([2, 4, 6]),
    bias=st.booleans(),
)
def test_qkv_any_tp_and_group_count_reassembles_q_k_v(tp, groups, q_per_group, head_dim, bias):
    assume(groups % tp == 0 or tp % groups == 0)
    assume((groups * (q_per_group + 2) * head_dim) % tp == 0)
    d = dims(num_heads=groups * q_per_group, num_kv_heads=groups, head_dim=head_dim)
    rest = () if bias else (d.hidden,)
    q = torch.randn(d.size("q_rows"), *rest)
    k, v = torch.randn(d.size("kv_rows"), *rest), torch.randn(d.size("kv_rows"), *rest)
    shape = (("q_rows",), ("kv_rows",), ("kv_rows",))
    if not bias:
        shape = tuple((s[0], "hidden") for s in shape)
    rule = QKVRule(("q", "k", "v"), shape)
    out = assemble(rule, d, list(megatron_qkv(q, k, v, groups).chunk(tp)), 0)
    assert torch.equal(out["q"], q) and torch.equal(out["k"], k) and torch.equal(out["v"], v)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gated_fc1_deinterleaves_each_rank(tp):
    d = dims()
    gate, up = torch.randn(12, 8), torch.randn(12, 8)
    shards = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp), strict=True)]
    out = assemble(GatedFc1Rule(("gate", "up"), (("ffn", "hidden"),) * 2), d, shards, 0)
    assert torch.equal(out["gate"], gate) and torch.equal(out["up"], up)
    # the plain concat of the ranks is a different tensor whenever TP > 1
    assert tp == 1 or not torch.equal(torch.cat(shards), torch.cat([gate, up]))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_parallel_concats_dim_1(tp):
    down = torch.randn(8, 12)
    out = assemble(RowRule(("down",), (("hidden", "ffn"),)), dims(), list(down.chunk(tp, 1)), 1)
    assert torch.equal(out["down"], down)


@pytest.mark.parametrize(("tp", "padded"), [(1, 10), (2, 16), (4, 16), (8, 16)])
def test_vocab_padding_is_trimmed_even_when_a_whole_shard_is_padding(tp, padded):
    emb = torch.randn(10, 8)
    full = torch.cat([emb, torch.full((padded - 10, 8), 7.0)])
    out = assemble(VocabRule(("embed",)), dims(), list(full.chunk(tp)), 0)
    assert torch.equal(out["embed"], emb)


def test_vocab_too_small_names_the_parameter():
    meta = ShardMeta("embedding.word_embeddings.weight", 0, None, "float32", (4, 8), 0)
    with pytest.raises(PlanError, match="embedding.word_embeddings.weight.*vocab_size=10"):
        VocabRule(("embed",)).place(ShardContext(meta, dims(), 0, 2))


@pytest.mark.parametrize(("etp", "local"), [(1, 2), (2, 2), (2, 1)])
def test_legacy_grouped_mlp_layout(etp, local):
    """``weight1.view(E_l, H, -1)[j]`` is expert j's ``[gate_r; up_r]`` transposed (see
    ``GroupedMLP.forward``); ``weight2.view(E_l, -1, H)[j]`` is its down proj transposed."""
    d = dims(num_experts=4, moe_ffn=6, moe_layers=frozenset({0}))
    experts = tuple(range(2, 2 + local))
    gate = {e: torch.randn(6, 8) for e in experts}
    up = {e: torch.randn(6, 8) for e in experts}
    down = {e: torch.randn(8, 6) for e in experts}
    w1, w2 = [], []
    for r in range(etp):
        blocks = [torch.cat([gate[e].chunk(etp)[r], up[e].chunk(etp)[r]]).t() for e in experts]
        w1.append(torch.stack(blocks).reshape(8, -1))
        w2.append(torch.stack([down[e].chunk(etp, 1)[r].t() for e in experts]).reshape(-1, 8))
    fc1 = GroupedFc1Rule(("g.{expert}", "u.{expert}"), (("moe_ffn", "hidden"),) * 2)
    fc2 = GroupedFc2Rule(("d.{expert}",), (("hidden", "moe_ffn"),))
    shapes1 = {f"{n}.{e}": ("moe_ffn", "hidden") for e in experts for n in "gu"}
    out1 = assemble(fc1, d, w1, 1, shapes1, experts=experts)
    out2 = assemble(
        fc2, d, w2, 0, {f"d.{e}": ("hidden", "moe_ffn") for e in experts}, experts=experts
    )
    for e in experts:
        assert torch.equal(out1[f"g.{e}"], gate[e]) and torch.equal(out1[f"u.{e}"], up[e])
        assert torch.equal(out2[f"d.{e}"], down[e])


def test_shape_contradicting_the_config_names_the_parameter():
    meta = ShardMeta(
        "decoder.layers.0.self_attention.linear_qkv.weight", 0, 0, "float32", (15, 8), 0
    )
    rule = QKVRule(
        ("q", "k", "v"), (("q_rows", "hidden"), ("kv_rows", "hidden"), ("kv_rows", "hidden"))
    )
    with pytest.raises(
        PlanError, match=r"'decoder.layers.0.self_attention.linear_qkv.weight' has shape \(15, 8\)"
    ):
        rule.place(ShardContext(meta, dims(), 0, 1, layer=0))
    with pytest.raises(PlanError, match="not divisible by the parallel size 3"):
        rule.place(ShardContext(meta, dims(), 0, 3, layer=0))


def test_replicated_rule_keeps_whole_tensor():
    meta = ShardMeta("n", 0, 0, "float32", (8,), None)
    ((name, piece),) = ReplicatedRule(("norm.{layer}",), (("hidden",),)).place(
        ShardContext(meta, dims(), 0, 1, layer=3)
    )
    assert name == "norm.3" and piece.is_whole


# --- pack_pieces ----------------------------------------------------------------------------------


def test_pack_row_chunks_equals_whole_and_casts_dtype():
    """A column-split tensor packed as 4 row chunks; bf16 shards land in a float32 tensor."""
    halves = [torch.randn(40, 3).to(torch.bfloat16) for _ in range(2)]
    shards = {f"s{i}": h for i, h in enumerate(halves)}
    pieces = [CopyPiece(f"s{i}", dst=((1, 3 * i, 3),)) for i in range(2)]
    spec = TensorSpec("t", "float32", (40, 6))
    plan = plan_buckets([spec], 256)  # 24-byte rows: 10 rows per chunk
    assert len(plan.buckets) == 4
    out = torch.empty(40, 6)
    for bucket in plan.buckets:
        buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        (entry,) = bucket.entries
        pack_pieces(buffer, entry, pieces, shards)
        first, rows = entry.tensor_offset // spec.row_bytes, entry.nbytes // spec.row_bytes
        raw = buffer[entry.offset : entry.offset + entry.nbytes]
        out[first : first + rows] = raw.view(torch.float32).view(rows, 6)
    assert torch.equal(out, torch.cat([h.float() for h in halves], 1))


def test_pack_rejects_chunks_that_are_not_whole_rows():
    spec = TensorSpec("big", "float32", (2, 100))
    entry = BucketEntry(spec, 0, 256, tensor_offset=256, chunk_index=1, num_chunks=4)
    buffer = torch.zeros(512, dtype=torch.uint8)
    with pytest.raises(PlanError, match="'big'.*not a range of whole rows"):
        pack_pieces(buffer, entry, [CopyPiece("s")], {"s": torch.zeros(2, 100)})


def test_pack_names_a_missing_shard():
    spec = TensorSpec("t", "float32", (4,))
    (bucket,) = plan_buckets([spec], 256).buckets
    with pytest.raises(PlanError, match="shard 'nope' is not registered"):
        pack_pieces(torch.zeros(256, dtype=torch.uint8), bucket.entries[0], [CopyPiece("nope")], {})


def test_pack_writes_only_the_piece_region():
    """A non-contiguous source slice lands in its destination slice; other bytes untouched."""
    spec = TensorSpec("t", "float32", (4, 6))
    (bucket,) = plan_buckets([spec], 256).buckets
    shard = torch.randn(4, 6)
    piece = CopyPiece("s", src=((1, 2, 3),), dst=((1, 0, 3),))
    buffer = torch.zeros(256, dtype=torch.uint8)
    pack_pieces(buffer, bucket.entries[0], [piece], {"s": shard})
    got = buffer[: spec.nbytes].view(torch.float32).view(4, 6)
    assert torch.equal(got[:, :3], shard[:, 2:5]) and not got[:, 3:].any()
