"""plan_rank / check_coverage on synthetic Megatron metadata (no megatron, no transformers)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from weightsync.errors import PlanError
from weightsync.sender.megatron import (
    RankTopology,
    ShardMeta,
    check_coverage,
    hf_manifest,
    plan_rank,
)
from weightsync.sender.megatron.name_table import template_of
from weightsync.sender.megatron.name_templates import ARCHITECTURES

H, HEADS, KV, HD, FFN, VOCAB, PADDED = 16, 4, 2, 4, 24, 30, 32


def config(model_type="llama", **kw):
    base = dict(
        model_type=model_type,
        num_hidden_layers=2,
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HD,
        intermediate_size=FFN,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    return SimpleNamespace(**{**base, **kw})


def S(name, layer, shape, pdim=None, dtype="float32", chunk=0):
    return ShardMeta(name, chunk, layer, dtype, shape, pdim)


def dense_rank(tp, layers=(0, 1), pre=True, post=True, tied=False, chunk=0):
    """The local-spec shards of a Llama-style GPT rank with TP size ``tp``."""
    qkv, q = (HEADS + 2 * KV) * HD, HEADS * HD
    out = []
    if pre:
        out.append(S("embedding.word_embeddings.weight", None, (PADDED // tp, H), 0, chunk=chunk))
    for i, layer in enumerate(layers):
        p = f"decoder.layers.{i}."
        out += [
            S(p + "input_layernorm.weight", layer, (H,), chunk=chunk),
            S(p + "self_attention.linear_qkv.weight", layer, (qkv // tp, H), 0, chunk=chunk),
            S(p + "self_attention.linear_proj.weight", layer, (H, q // tp), 1, chunk=chunk),
            S(p + "pre_mlp_layernorm.weight", layer, (H,), chunk=chunk),
            S(p + "mlp.linear_fc1.weight", layer, (2 * FFN // tp, H), 0, chunk=chunk),
            S(p + "mlp.linear_fc2.weight", layer, (H, FFN // tp), 1, chunk=chunk),
        ]
    if post:
        out.append(S("decoder.final_layernorm.weight", None, (H,), chunk=chunk))
        out.append(S("output_layer.weight", None, (PADDED // tp, H), 0, chunk=chunk))
    return out


def tp_plans(tp=2, cfg=None, **kw):
    cfg = cfg or config()
    return [
        plan_rank(dense_rank(tp, **kw), RankTopology(tp_rank=r, tp_size=tp), cfg) for r in range(tp)
    ]


def test_manifest_is_the_same_on_every_rank_and_ordered_like_hf():
    plans = tp_plans()
    assert plans[0].manifest == plans[1].manifest == hf_manifest(config(), "float32")
    names = [s.name for s in plans[0].manifest]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    assert names[1:4] == [
        f"model.layers.0.{n}"
        for n in ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight")
    ]
    shapes = {s.name: s.shape for s in plans[0].manifest}
    assert shapes["model.embed_tokens.weight"] == (VOCAB, H)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (H, FFN)
    check_coverage(plans)


def test_data_parallel_replicas_write_nothing():
    cfg = config()
    plans = tp_plans(cfg=cfg)
    replica = plan_rank(
        dense_rank(2), RankTopology(tp_rank=0, tp_size=2, dp_rank=1, dp_size=2), cfg
    )
    assert not replica.pieces
    check_coverage([*plans, replica])


def test_replicated_params_are_written_by_tp_rank_0_only():
    plans = tp_plans()
    norm = "model.layers.0.input_layernorm.weight"
    assert plans[0].pieces_for(norm) and not plans[1].pieces_for(norm)


def test_tp_ranks_hold_copies_of_replicated_params_that_only_tp_rank_0_writes():
    """Planned with every replica, TP rank 1 lists its whole copy of each replicated tensor
    (norms, row-parallel biases) among its copies, not its pieces: coverage stays exact."""
    cfg = config()
    plans = [
        plan_rank(dense_rank(2), RankTopology(tp_rank=r, tp_size=2), cfg, every_replica=True)
        for r in range(2)
    ]
    replicated = {n for n, ps in plans[0].pieces.items() if n not in plans[1].pieces}
    assert "model.layers.0.input_layernorm.weight" in replicated
    assert not plans[0].copies and set(plans[1].copies) == replicated
    for name in replicated:
        (own,) = plans[1].copies[name]
        (written,) = plans[0].pieces[name]
        assert own.dst == written.dst == () and own.shard_key == written.shard_key
    check_coverage(plans)
    assert not plan_rank(dense_rank(2), RankTopology(tp_rank=1, tp_size=2), cfg).copies


def test_missing_rank_names_the_tensor_and_the_rank():
    with pytest.raises(PlanError, match=r"'model\.embed_tokens\.weight'.*missing ranks: tp1 pp0"):
        check_coverage(tp_plans()[:1])


def test_missing_parameter_names_the_tensor():
    cfg = config()
    shards = [s for s in dense_rank(1) if "layers.1.mlp.linear_fc2" not in s.name]
    with pytest.raises(
        PlanError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight'.*no rank is missing"
    ):
        check_coverage([plan_rank(shards, RankTopology(), cfg)])


def test_two_ranks_claiming_the_same_shard_name_the_parameter():
    plans = tp_plans()
    with pytest.raises(
        PlanError,
        match=r"written twice: by Megatron parameter 'embedding\.word_embeddings\.weight' on",
    ):
        check_coverage([plans[0], plans[0], plans[1]])


def test_different_manifests_are_rejected():
    a = tp_plans()[0]
    b = plan_rank(dense_rank(2), RankTopology(tp_rank=1, tp_size=2), config(), dtype="bfloat16")
    with pytest.raises(PlanError, match="different manifest"):
        check_coverage([a, b])


def test_unknown_parameter_is_named():
    shards = [*dense_rank(1), S("decoder.layers.0.mlp.linear_fc3.weight", 0, (4, 4), 0)]
    with pytest.raises(
        PlanError, match=r"'decoder\.layers\.0\.mlp\.linear_fc3\.weight' has no rule"
    ):
        plan_rank(shards, RankTopology(), config())


def test_mtp_layers_are_not_silently_dropped():
    shards = [*dense_rank(1), S("mtp.layers.0.enorm.weight", 2, (H,))]
    with pytest.raises(
        PlanError, match=r"'mtp\.layers\.0\.enorm\.weight' belongs to an MTP.*export_mtp=False"
    ):
        plan_rank(shards, RankTopology(), config())
    plan = plan_rank(shards, RankTopology(), config(), export_mtp=False)
    assert "0:mtp.layers.0.enorm.weight" not in plan.shards
    check_coverage([plan])


def test_parameter_without_hf_counterpart_in_this_config():
    shards = [*dense_rank(1), S("decoder.layers.0.self_attention.linear_qkv.bias", 0, (32,), 0)]
    with pytest.raises(PlanError, match=r"linear_qkv\.bias' has no HF counterpart.*qkv_bias"):
        plan_rank(shards, RankTopology(), config())
    plan = plan_rank(shards, RankTopology(), config(attention_bias=True))
    assert "model.layers.0.self_attn.q_proj.bias" in plan.pieces


def test_partition_dim_contradicting_the_rule_is_named():
    shards = [
        replace(s, partition_dim=0) if s.name.endswith("linear_proj.weight") else s
        for s in dense_rank(1)
    ]
    with pytest.raises(PlanError, match=r"linear_proj\.weight' has partition_dim=0.*expects 1"):
        plan_rank(shards, RankTopology(), config())
    shards = [
        replace(s, partition_dim=0) if s.name.endswith("input_layernorm.weight") else s
        for s in dense_rank(1)
    ]
    with pytest.raises(PlanError, match=r"input_layernorm\.weight' has partition_dim=0"):
        plan_rank(shards, RankTopology(), config())


def test_layer_beyond_the_hf_config_is_named():
    with pytest.raises(PlanError, match=r"global layer 5.*num_hidden_layers=2"):
        plan_rank(dense_rank(1, layers=(0, 5)), RankTopology(), config())


def test_tied_embeddings_send_embed_tokens_only():
    cfg = config(tie_word_embeddings=True)
    # PP=2: the last stage keeps a synchronized copy of the embedding as output_layer.weight
    first = plan_rank(dense_rank(1, layers=(0,), post=False), RankTopology(pp_size=2), cfg)
    last = plan_rank(
        dense_rank(1, layers=(1,), pre=False),
        RankTopology(pp_rank=1, pp_size=2),
        cfg,
        tied_embeddings=True,
    )
    assert "lm_head.weight" not in {s.name for s in first.manifest}
    check_coverage([first, last])
    with pytest.raises(PlanError, match="share_embeddings_and_output_weights=False"):
        plan_rank(dense_rank(1), RankTopology(), cfg, tied_embeddings=False)


def test_dtype_is_inferred_or_must_be_given():
    shards = [replace(s, dtype="bfloat16") if "layers.0" in s.name else s for s in dense_rank(1)]
    with pytest.raises(PlanError, match="cannot infer the model dtype.*pass dtype="):
        plan_rank(shards, RankTopology(), config())
    plan = plan_rank(shards, RankTopology(), config(), dtype="bfloat16")
    assert {s.dtype for s in plan.manifest} == {"bfloat16"}


def test_unsupported_model_type_lists_the_supported_ones():
    with pytest.raises(PlanError, match=r"'gpt2' is not supported; supported: \[.*'qwen3_moe'"):
        plan_rank(dense_rank(1), RankTopology(), config("gpt2"))


def moe_config(**kw):
    return config(
        "qwen3_moe",
        num_experts=4,
        moe_intermediate_size=8,
        mlp_only_layers=[],
        decoder_sparse_step=1,
        **kw,
    )


def moe_rank(
    ep_rank, ep, etp=1, etp_rank=0, prefix="decoder.layers.0.mlp.experts.local_experts.{j}."
):
    local = 4 // ep
    out = [S("decoder.layers.0.mlp.router.weight", 0, (4, H))]
    for j in range(local):
        p = prefix.format(j=j)
        out += [
            S(p + "linear_fc1.weight", 0, (16 // etp, H), 0),
            S(p + "linear_fc2.weight", 0, (H, 8 // etp), 1),
        ]
    return out


def test_expert_parallel_offsets_and_expert_tp():
    cfg = moe_config(num_hidden_layers=1)
    plans = []
    for ep_rank in range(2):
        for etp_rank in range(2):
            topo = RankTopology(
                ep_rank=ep_rank,
                ep_size=2,
                etp_rank=etp_rank,
                etp_size=2,
                dp_rank=ep_rank * 2 + etp_rank,
                dp_size=4,
            )
            plans.append(plan_rank(moe_rank(ep_rank, 2, 2, etp_rank), topo, cfg))
    ep1_etp1 = plans[3]
    assert set(ep1_etp1.pieces) == {
        f"model.layers.0.mlp.experts.{e}.{n}.weight"
        for e in (2, 3)
        for n in ("gate_proj", "up_proj", "down_proj")
    }
    (piece,) = ep1_etp1.pieces["model.layers.0.mlp.experts.3.down_proj.weight"]
    assert piece.dst == ((1, 4, 4),)
    # only dp_rank 0 writes the (replicated) router; attention etc. are absent from these shards
    router = "model.layers.0.mlp.gate.weight"
    assert [bool(p.pieces_for(router)) for p in plans] == [True, False, False, False]
    with pytest.raises(PlanError, match=r"'model\.embed_tokens\.weight'.*written by no rank"):
        check_coverage(plans)


def test_local_expert_index_beyond_ep_split_is_named():
    shards = moe_rank(0, 1)  # 4 local experts, but the topology says EP=2 (2 per rank)
    with pytest.raises(
        PlanError,
        match=r"local_experts\.2\.linear_fc1\.weight' is local expert 2.*leave 2 per rank",
    ):
        plan_rank(shards, RankTopology(ep_size=2, dp_size=2), moe_config(num_hidden_layers=1))


def te_grouped(name: str) -> str:
    """``TEGroupedMLP`` spelling: ``mlp.experts.linear_fc1.weight<local expert>``."""
    _, expert = template_of(name)
    if expert is None:
        return name
    fc = "linear_fc1" if "linear_fc1" in name else "linear_fc2"
    return name.split(".local_experts.")[0] + f".{fc}.weight{expert}"


def test_te_grouped_names_plan_like_sequential_mlp():
    cfg = moe_config(num_hidden_layers=1)
    seq = plan_rank(moe_rank(0, 1), RankTopology(), cfg)
    te = plan_rank(
        [replace(s, name=te_grouped(s.name)) for s in moe_rank(0, 1)], RankTopology(), cfg
    )
    assert any(k.endswith("linear_fc2.weight3") for k in te.shards)

    def dsts(plan):
        return {n: [p.dst for p in ps] for n, ps in plan.pieces.items()}

    assert dsts(te) == dsts(seq)


def test_every_table_template_is_what_its_concrete_names_canonicalize_to():
    for arch in ARCHITECTURES:
        for template, _ in arch.mappings():
            concrete = template.replace("{layer}", "3").replace("{expert}", "1")
            assert template_of(concrete)[0] == template


def test_embedding_replica_on_a_later_stage_is_not_written():
    """With MTP on the last stage megatron keeps a synchronized copy of the word embeddings."""
    cfg = config()
    first = plan_rank(dense_rank(1, layers=(0,), post=False), RankTopology(pp_size=2), cfg)
    last_shards = [*dense_rank(1, layers=(1,), pre=False), *dense_rank(1, layers=(), post=False)]
    last = plan_rank(last_shards, RankTopology(pp_rank=1, pp_size=2), cfg)
    assert "0:embedding.word_embeddings.weight" in last.shards
    assert not last.pieces_for("model.embed_tokens.weight")
    check_coverage([first, last])
