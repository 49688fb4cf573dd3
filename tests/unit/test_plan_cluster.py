"""Described clusters as sources and receivers (Megatron ownership, engine slices) and the
planner across hosts: broadcast chains against point-to-point, the floor, refused layouts."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from pydantic import ValidationError

from weightsync.cluster import Topology, cluster, plan_cluster, runtime_estimate
from weightsync.errors import ConfigError
from weightsync.topology import Box, Link, Piece, TopologyPlan, plan_topology, whole_box
from weightsync.topology_model import route_links

from .test_topology import clusters

# A tiny DeepSeek-V3: MLA, one dense layer then MoE layers with 8 experts and a shared one.
MOE = dict(
    model_type="deepseek_v3", vocab_size=512, hidden_size=256, intermediate_size=384,
    moe_intermediate_size=128, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128,
    kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
)  # fmt: skip
GQA = dict(
    model_type="qwen3", vocab_size=512, hidden_size=256, intermediate_size=384,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
)  # fmt: skip


def topo(trainer: dict, engines: dict, transfer: str = "broadcast") -> Topology:
    return Topology.model_validate(
        {"model": {"preset": "kimi-k2"}, "trainer": trainer, "engines": engines,
         "transfer": transfer}
    )  # fmt: skip


TRAINER = dict(hosts=2, gpus_per_host=4, tp=2, pp=2, ep=2)  # a stage per host
ENGINES = dict(replicas=2, tp=4, ep=2, gpus_per_host=4, dtype="bf16")  # a replica per host


def holders(sources, name: str) -> dict[Box, list[int]]:
    out: dict[Box, list[int]] = defaultdict(list)
    for s in sources:
        for p in s.pieces:
            if p.tensor == name:
                out[p.box].append(s.rank)
    return dict(out)


def test_trainer_ranks_hold_what_megatron_gives_them():
    _, sources, _ = cluster(topo(TRAINER, ENGINES), MOE)
    assert {s.host for s in sources[:4]} == {"trainer-0"} and sources[4].host == "trainer-1"
    # Stage 0 (ranks 0-3, layers 0-1) holds the embedding, vocab-split over TP (rank % 2).
    assert holders(sources, "model.embed_tokens.weight") == {
        Box((0, 0), (256, 256)): [0, 2],
        Box((256, 0), (256, 256)): [1, 3],
    }
    # Stage 1 (ranks 4-7, layers 2-3) holds lm_head, and o_proj split along dim 1.
    assert sorted(holders(sources, "lm_head.weight").values()) == [[4, 6], [5, 7]]
    o = holders(sources, "model.layers.3.self_attn.o_proj.weight")
    assert o == {Box((0, 0), (256, 64)): [4, 6], Box((0, 64), (256, 64)): [5, 7]}
    # MLA's down projection is whole on every TP rank; experts 0-3 on EP rank 0 of the stage,
    # 4-7 on EP rank 1; EP is fastest in the stage's expert order (etp-ep-dp), expert-DP 2:
    # EP rank 0 is ranks 4 and 6, EP rank 1 ranks 5 and 7.
    assert list(holders(sources, "model.layers.2.self_attn.q_a_proj.weight").values()) == [
        [4, 5, 6, 7]
    ]
    assert list(holders(sources, "model.layers.2.mlp.experts.3.down_proj.weight").values()) == [
        [4, 6]
    ]
    assert list(holders(sources, "model.layers.3.mlp.experts.4.up_proj.weight").values()) == [
        [5, 7]
    ]


def test_engine_ranks_need_only_their_slice():
    tensors, _, receivers = cluster(topo(TRAINER, ENGINES), MOE)
    r2 = {p.tensor: p.box for p in receivers[2].needs}  # replica 0, TP rank 2, EP group 1
    assert receivers[2].id == "r0/tp2" and receivers[6].host == "engine-1"
    assert r2["model.layers.1.self_attn.q_b_proj.weight"] == Box((128, 0), (64, 128))
    assert r2["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == Box((0, 0), (96, 256))
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" not in r2
    # EP 2 of TP 4: each EP group splits its experts over 2 ranks.
    assert r2["model.layers.1.mlp.experts.4.gate_proj.weight"] == Box((0, 0), (64, 256))
    assert receivers[2].needs is receivers[6].needs  # one tuple per TP rank, every replica
    # A replica's ranks together hold every tensor: split ones once, replicated ones each.
    for x in tensors:
        numel = sum(p.box.numel for r in receivers[:4] for p in r.needs if p.tensor == x.name)
        assert numel == whole_box(x.shape).numel * (4 if x.split == "replicated" else 1), x.name


def test_gqa_kv_heads_fewer_than_engine_ranks_are_shared_by_whole_heads():
    _, _, receivers = cluster(
        topo(dict(hosts=1, gpus_per_host=4, tp=4), dict(replicas=1, tp=4, gpus_per_host=4)), GQA
    )
    k = [dict((p.tensor, p.box) for p in r.needs)["model.layers.0.self_attn.k_proj.weight"]
         for r in receivers]  # fmt: skip
    assert k == [Box((0, 0), (64, 256))] * 2 + [Box((64, 0), (64, 256))] * 2


def check_plan(plan: TopologyPlan, tensors, sources, receivers) -> None:
    """Every receiver gets exactly its needs; relayed bytes come from a receiver that got them;
    link bytes are the hops' bytes; floor <= predicted."""
    every = tuple(Piece(t.name, whole_box(t.shape)) for t in tensors)
    by_rank = {s.rank: s for s in sources}
    at = {r.id: (r.gpu, r.host) for r in receivers}
    got = defaultdict(list)
    links: dict[Link, int] = defaultdict(int)
    for t in plan.transfers:
        got[(t.receiver, t.tensor)].append(t.box)
    for t in plan.transfers:
        src = by_rank[t.source]
        assert any(p.tensor == t.tensor and p.box.contains(t.box) for p in src.pieces)
        frm = at[t.via] if t.via else (src.gpu, src.host)
        if t.via:
            # It relays what it got (perhaps in several transfers: theirs do not overlap).
            held = (t.box.intersect(b) for b in got[(t.via, t.tensor)])
            assert sum(b.numel for b in held if b is not None) == t.box.numel
        dst = at[t.receiver]
        assert t.route == ("local" if frm[0] == dst[0] else "peer" if frm[1] == dst[1]
                           else "remote")  # fmt: skip
        for link in route_links(t.route, frm, at[t.receiver]):
            links[link] += t.nbytes
    for r in receivers:
        for need in r.needs or every:
            if not need.box.numel:
                continue
            boxes = got[(r.id, need.tensor)]
            assert sum(b.numel for b in boxes) == need.box.numel
            assert all(need.box.contains(b) for b in boxes)
    assert plan.link_bytes == links
    assert plan.floor_s <= plan.predicted_s * (1 + 1e-9)


def test_broadcast_sends_each_slice_once_and_relays_between_hosts():
    t = topo(TRAINER, dict(ENGINES, replicas=4))
    tensors, sources, receivers = cluster(t, MOE)
    plan = plan_cluster(t, MOE)
    p2p = plan_cluster(t.model_copy(update={"transfer": "p2p"}), MOE)
    check_plan(plan, tensors, sources, receivers)
    check_plan(p2p, tensors, sources, receivers)
    model = sum(x.nbytes for x in tensors)
    # Broadcast: the trainer sends each slice once (a replicated tensor once in all) and the
    # engines relay it; point-to-point: once per receiver.
    one_replica = sum(plan.receiver_bytes[f"r0/tp{i}"] for i in range(4))
    assert sum(plan.source_bytes.values()) < one_replica < 2 * model
    assert sum(p2p.source_bytes.values()) == 4 * one_replica
    assert sum(plan.receiver_bytes.values()) == sum(p2p.receiver_bytes.values())
    assert any(x.via for x in plan.transfers) and not any(x.via for x in p2p.transfers)
    # Replicated tensors enter each engine host once, then go over NVLink.
    assert plan.route_bytes["peer"] > 0 and p2p.route_bytes["peer"] == 0
    assert plan.predicted_s < p2p.predicted_s
    assert plan.floor_bound.startswith("host engine-")


def test_every_trainer_host_sends_and_balances_the_copies_it_shares():
    t = topo(dict(hosts=4, gpus_per_host=2, tp=1, pp=1, ep=1), dict(ENGINES, ep=1), "p2p")
    plan = plan_cluster(t, GQA)
    sent = [plan.source_bytes[r] for r in range(8)]  # DP=8: every rank holds everything
    assert min(sent) > 0 and max(sent) <= 1.2 * min(sent)


def test_the_runtime_as_built_sends_each_stage_from_its_host_sliced_per_engine_rank():
    """Engines TP=4 x 2 replicas: each trainer host sends its stage's boxes once to each of the
    4 TP rank groups (2 members each); an engine GPU takes only its slice."""
    t = topo(TRAINER, ENGINES)
    built = cluster(t, MOE)
    run = runtime_estimate(t, built)
    tensors, _, receivers = built
    assert run.parts.hosts == ("trainer-0", "trainer-1")  # a PP stage per host
    assert run.parts.owner["model.embed_tokens.weight"] == "trainer-0"
    assert run.parts.owner["lm_head.weight"] == "trainer-1"
    assert run.parts.owner["model.layers.3.mlp.experts.7.down_proj.weight"] == "trainer-1"
    by_name = {x.name: x for x in tensors}

    def nbytes(piece) -> int:
        x = by_name[piece.tensor]
        return piece.box.numel * x.nbytes // whole_box(x.shape).numel

    kept = {r.id: sum(map(nbytes, r.needs)) for r in receivers}
    assert run.taken == max(kept.values()) < sum(x.nbytes for x in tensors) / 2
    ranks = {r.id.split("/")[1]: r.needs for r in receivers}  # one group per TP rank
    assert len(ranks) == 4
    assert sum(run.sent.values()) == sum(sum(map(nbytes, n)) for n in ranks.values())
    # Replicated tensors (norms, routers, MLA's down projections) go to every group.
    assert sum(run.sent.values()) > sum(x.nbytes for x in tensors)
    assert run.predicted_s == max(run.taken, *run.sent.values()) / (t.links.nic_gb_s * 1e9)
    host, sent = run.busiest_part
    assert run.bound == f"trainer host {host}'s sender sending its part's slices from one GPU"
    assert run.predicted_s >= plan_cluster(t, MOE).predicted_s


def test_the_runtime_as_built_balances_parts_over_hosts_holding_copies():
    t = topo(dict(hosts=4, gpus_per_host=2, tp=1, pp=1, ep=1), dict(ENGINES, ep=1))
    run = runtime_estimate(t, cluster(t, GQA))
    parts = [run.parts.bytes_of(h) for h in run.parts.hosts]
    largest = max(x.nbytes for x in cluster(t, GQA)[0])
    assert len(parts) == 4 and max(parts) - min(parts) <= largest
    assert sum(parts) == sum(x.nbytes for x in cluster(t, GQA)[0])


def test_layouts_that_do_not_fit_are_refused_naming_the_field():
    with pytest.raises(ValidationError, match="TP group spanning hosts"):
        topo(dict(TRAINER, tp=8, pp=1), ENGINES)
    with pytest.raises(ValidationError, match="ep=3 must divide tp=4"):
        topo(TRAINER, dict(ENGINES, ep=3))
    with pytest.raises(ConfigError, match="trainer.ep=16 must divide the model's 8 experts"):
        cluster(topo(dict(TRAINER, hosts=8, ep=16), ENGINES), MOE)
    with pytest.raises(ConfigError, match="pp_layers adds up to 3; the model has 4 layers"):
        cluster(topo(dict(TRAINER, pp_layers=[1, 2]), ENGINES), MOE)
    assert whole_box((2, 3)).numel == 6


@settings(max_examples=100, deadline=None)
@given(clusters())
def test_any_cluster_is_covered_exactly_by_broadcast_chains(drawn):
    manifest, sources, receivers, split = drawn
    plan = plan_topology(manifest, sources, receivers, split_min_bytes=split, broadcast=True)
    check_plan(plan, manifest, sources, receivers)
    p2p = plan_topology(manifest, sources, receivers, split_min_bytes=split)
    assert plan.receiver_bytes == p2p.receiver_bytes
    assert sum(plan.source_bytes.values()) <= sum(p2p.source_bytes.values())
