"""Real megatron-core 0.16.1 models on CPU over gloo -> HF tensors, checked bit for bit.

Every layout's conversion must equal, bit for bit, the conversion of a TP=1/PP=1/EP=1 model
with the same global weights, and the HF model that receives them must produce Megatron's
logits. Parameters are filled from their *global* names, cut the way megatron cuts its own
init (see ``fill_by_global_name``), because layers and experts built on different ranks draw
from the RNG in a different order; one test also checks plain same-seed init.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.support import megatron as ms
from weightsync.errors import PlanError
from weightsync.sender.megatron import (
    LocalShards,
    ShardMeta,
    check_coverage,
    convert_megatron_to_hf,
    plan_rank,
)

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")
pytestmark = pytest.mark.megatron

DENSE = [c.name for c in ms.DENSE_CASES]
MOE = [c.name for c in ms.MOE_CASES]

LAYOUTS = {
    "tp2": ({"tp": 2, "pp": 1}, DENSE + MOE),
    "pp2": ({"tp": 1, "pp": 2}, DENSE + ["qwen3_moe", "glm4_moe_expert_bias"]),
    "pp2_vpp2": ({"tp": 1, "pp": 2, "vpp": 2}, DENSE + ["qwen3_moe"]),
    "pp2_uneven": (
        {"tp": 1, "pp": 2, "first_stage_layers": 1, "last_stage_layers": 3},
        ["llama_mqa_tied", "glm4_moe_expert_bias"],
    ),
    "ep2": ({"tp": 1, "pp": 1, "ep": 2}, MOE),
    "tp2_ep2": ({"tp": 2, "pp": 1, "ep": 2, "etp": 1}, MOE),
    "tp2_ep2_etp2": ({"tp": 2, "pp": 1, "ep": 2, "etp": 2}, ["qwen3_moe", "glm4_moe_expert_bias"]),
}
"""``tp2`` with MoE is expert-TP 2 (megatron's default expert_tensor_parallel_size = TP);
``tp2_ep2_etp2`` runs on 4 ranks, so dense parameters also have a data-parallel replica."""


class Runs:
    """Each layout is launched once per module, on first use."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._cache: dict[str, dict] = {}

    def get(self, key: str, sizes: dict, cases: list[str], fill: bool = True) -> dict:
        if key not in self._cache:
            tmp = self._tmp.mktemp(key)
            logits = sizes["pp"] == 1
            self._cache[key] = ms.launch(tmp, sizes, ms.collect_worker, cases, fill, logits)[0]
        return self._cache[key]

    def reference(self) -> dict:
        return self.get("ref", {"tp": 1, "pp": 1}, list(ms.CASES))

    def layout(self, key: str) -> dict:
        sizes, cases = LAYOUTS[key]
        return self.get(key, sizes, cases)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory)


def convert(run: dict, case: str, **kwargs) -> dict[str, torch.Tensor]:
    return convert_megatron_to_hf(run[case]["states"], ms.hf_config(ms.CASES[case]), **kwargs)


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), f"{name} differs"


LAYOUT_CASES = [(k, c) for k, (_, cases) in LAYOUTS.items() for c in cases]


@pytest.mark.parametrize(
    ("layout", "case"), LAYOUT_CASES, ids=[f"{k}-{c}" for k, c in LAYOUT_CASES]
)
def test_layout_converts_bit_identical_to_tp1(runs, layout, case):
    assert_bit_identical(convert(runs.layout(layout), case), convert(runs.reference(), case))


@pytest.mark.parametrize("case", list(ms.CASES))
def test_transformers_logits_equal_megatron_logits(runs, case, tmp_path):
    """TP=1 forward vs ``from_pretrained`` of the converted checkpoint (no missing keys)."""
    ref = runs.reference()[case]
    hf = convert(runs.reference(), case, export_mtp=False)  # transformers has no MTP layers
    model, info = ms.hf_model(ms.CASES[case], hf, tmp_path)
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model(ms.input_ids(ms.CASES[case])).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    ("layout", "case"),
    [
        ("tp2", "qwen3_qknorm"),
        ("tp2", "llama_mqa_tied"),
        ("ep2", "qwen3_moe"),
        ("tp2_ep2", "glm4_moe_expert_bias"),
    ],
)
def test_parallel_forward_matches_transformers(runs, layout, case, tmp_path):
    """Megatron's own TP / EP forward agrees with the HF model built from that layout's shards."""
    run = runs.layout(layout)[case]
    hf = convert(runs.layout(layout), case, export_mtp=False)
    model, _ = ms.hf_model(ms.CASES[case], hf, tmp_path)
    with torch.no_grad():
        logits = model(ms.input_ids(ms.CASES[case])).logits
    torch.testing.assert_close(logits, run["logits"], rtol=0, atol=2e-5)


def test_mtp_layer_exports_after_the_decoder_layers(runs):
    """GLM-4.5 / DeepSeek-V3 checkpoints (and vLLM's glm4_moe_mtp) name MTP layer i
    ``model.layers.{num_layers + i}``; PP=2 builds it on the last stage."""
    hf = convert(runs.layout("pp2"), "glm4_moe_expert_bias")
    mtp = {k for k in hf if k.startswith("model.layers.4.")}
    assert {
        f"model.layers.4.{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm")
    } <= mtp
    assert "model.layers.4.mlp.experts.3.down_proj.weight" in mtp
    assert "model.layers.4.self_attn.q_proj.bias" in mtp
    assert hf["model.layers.4.eh_proj.weight"].shape == (128, 256)
    skipped = convert(runs.layout("pp2"), "glm4_moe_expert_bias", export_mtp=False)
    assert set(hf) - set(skipped) == mtp


def test_data_parallel_replicas_write_no_dense_bytes(runs):
    case = "qwen3_moe"
    states = runs.layout("tp2_ep2_etp2")[case]["states"]
    assert sorted((t.dp_rank, t.ep_rank) for t in states) == [(0, 0), (0, 0), (1, 1), (1, 1)]
    cfg = ms.hf_config(ms.CASES[case])
    for topology, state in states.items():
        plan = plan_rank(state.shards, topology, cfg)
        dense = [n for n in plan.pieces if ".experts." not in n]
        assert bool(dense) == (topology.dp_rank == 0)
        assert any(".experts." in n for n in plan.pieces)  # every rank writes its experts


def test_uneven_pipeline_stages_hold_1_and_3_layers(runs):
    states = runs.layout("pp2_uneven")["llama_mqa_tied"]["states"]
    layers = {
        t.pp_rank: {s.layer for s in st.shards if s.layer is not None} for t, st in states.items()
    }
    assert layers == {0: {0}, 1: {1, 2, 3}}


def test_pipeline_layer_numbers_follow_megatron_vpp_order(runs):
    """PP=2 x VPP=2 over 4 layers: rank 0 holds layers 0 and 2, rank 1 holds 1 and 3."""
    states = runs.layout("pp2_vpp2")["llama_gqa"]["states"]
    layers = {}
    for topology, state in states.items():
        for shard in state.shards:
            if shard.layer is not None:
                layers.setdefault((topology.pp_rank, shard.vpp_chunk), set()).add(shard.layer)
        assert {s.name.split(".")[2] for s in state.shards if s.layer is not None} == {"0"}
    assert layers == {(0, 0): {0}, (0, 1): {2}, (1, 0): {1}, (1, 1): {3}}


def test_same_seed_tp2_reassembles_megatron_init(tmp_path):
    """No fill: megatron's own init at TP=2 converts to exactly its TP=1 init (same seed)."""
    cases = ["llama_mqa_tied", "qwen3_qknorm"]
    ref = ms.launch(tmp_path, {"tp": 1, "pp": 1}, ms.collect_worker, cases, False, False)[0]
    tp2 = ms.launch(tmp_path, {"tp": 2, "pp": 1}, ms.collect_worker, cases, False, False)[0]
    for case in cases:
        assert_bit_identical(convert(tp2, case), convert(ref, case))


@pytest.mark.parametrize(
    ("layout", "case"), [("tp2", "llama_gqa"), ("tp2_ep2", "qwen2_moe_shared")]
)
def test_chunked_buckets_pack_the_same_bytes(runs, layout, case):
    """A 4 KiB cap splits embeddings and experts into row chunks packed rank by rank."""
    run = runs.layout(layout)
    assert_bit_identical(convert(run, case, bucket_size_bytes=4096), convert(run, case))


def test_expert_bias_stays_float32_in_a_bf16_model(runs):
    run = runs.layout("ep2")["glm4_moe_expert_bias"]
    states = {}
    for topology, state in run["states"].items():
        tensors = {
            k: t if k.endswith("expert_bias") else t.to(torch.bfloat16)
            for k, t in state.tensors.items()
        }
        shards = tuple(
            s
            if s.name.endswith("expert_bias")
            else ShardMeta(**{**s.__dict__, "dtype": "bfloat16"})
            for s in state.shards
        )
        states[topology] = LocalShards(topology, shards, tensors, state.tied_embeddings)
    hf = convert_megatron_to_hf(states, ms.hf_config(ms.CASES["glm4_moe_expert_bias"]))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert hf[bias].dtype == torch.float32
    assert hf["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    want = convert(runs.reference(), "glm4_moe_expert_bias")
    assert torch.equal(hf[bias], want[bias])


# --- TE spec and legacy GroupedMLP names, by name mapping ----------------------------------------


def te_name(name: str, moe_layer: bool) -> str:
    """The TE-spec name of a local-spec parameter.

    TransformerEngine cannot run on CPU, so TE models are tested by renaming real local-spec
    shards the way megatron-core names TE modules: the dense layer norms are fused into the next
    linear (megatron's own ``sharded_state_dict_keys_map`` of the local spec), MoE layers keep
    ``pre_mlp_layernorm`` (TE spec: ``pre_mlp_layernorm=layer_norm() if num_experts``), and
    ``TEGroupedMLP`` names experts ``mlp.experts.linear_fc1.weight<i>``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    for local, te in keys_map.items():
        if moe_layer and local == "pre_mlp_layernorm.":
            continue
        name = name.replace(f".{local}", f".{te}")
    return re.sub(
        r"\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", r".experts.\2.weight\1", name
    )


def renamed(states: dict, rename) -> dict:
    out = {}
    for topology, state in states.items():
        shards, tensors = [], {}
        for shard in state.shards:
            new = ShardMeta(**{**shard.__dict__, "name": rename(shard)})
            shards.append(new)
            tensors[new.key] = state.tensors[shard.key]
        out[topology] = LocalShards(topology, tuple(shards), tensors, state.tied_embeddings)
    return out


@pytest.mark.parametrize(
    ("layout", "case"),
    [("tp2", "starcoder2_nongated"), ("tp2", "qwen3_moe"), ("tp2_ep2", "mixtral")],
)
def test_te_spec_names_convert_like_local_spec(runs, layout, case):
    mc = ms.CASES[case]
    states = runs.layout(layout)[case]["states"]
    te = renamed(states, lambda s: te_name(s.name, s.layer is not None and mc.is_moe(s.layer)))
    names = {s.name for st in te.values() for s in st.shards}
    assert any("linear_qkv.layer_norm_weight" in n for n in names)
    hf = convert_megatron_to_hf(te, ms.hf_config(mc))
    assert_bit_identical(hf, convert(runs.layout(layout), case))


def grouped_states(states: dict, case: ms.ModelCase) -> dict:
    """SequentialMLP shards re-laid out as legacy ``GroupedMLP`` ``weight1`` / ``weight2``.

    ``GroupedMLP.forward`` reads expert j as ``weight1.view(E_l, H, -1)[j]`` (= fc1_j.T) and
    ``weight2.view(E_l, -1, H)[j]`` (= fc2_j.T); grouped_gemm is not installed on CPU, so the
    layout is built from that definition.
    """
    expert = re.compile(r"(.*\.mlp\.experts)\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
    out = {}
    for topology, state in states.items():
        shards, tensors, groups = [], {}, {}
        for shard in state.shards:
            m = expert.match(shard.name)
            if m is None:
                shards.append(shard)
                tensors[shard.key] = state.tensors[shard.key]
                continue
            key = (f"{m.group(1)}.weight{m.group(3)}", shard.vpp_chunk, shard.layer, shard.dtype)
            groups.setdefault(key, {})[int(m.group(2))] = state.tensors[shard.key]
        for (name, chunk, layer, dtype), by_expert in groups.items():
            blocks = torch.stack([by_expert[j].t() for j in sorted(by_expert)])
            fc1 = name.endswith("1")
            weight = blocks.reshape((case.hidden, -1) if fc1 else (-1, case.hidden))
            meta = ShardMeta(name, chunk, layer, dtype, tuple(weight.shape), 1 if fc1 else 0)
            shards.append(meta)
            tensors[meta.key] = weight
        out[topology] = LocalShards(topology, tuple(shards), tensors, state.tied_embeddings)
    return out


@pytest.mark.parametrize("layout", ["tp2", "tp2_ep2"])
def test_legacy_grouped_mlp_layout_converts_like_sequential_mlp(runs, layout):
    mc = ms.CASES["qwen3_moe"]
    grouped = grouped_states(runs.layout(layout)["qwen3_moe"]["states"], mc)
    assert any(s.name.endswith("experts.weight1") for st in grouped.values() for s in st.shards)
    hf = convert_megatron_to_hf(grouped, ms.hf_config(mc))
    assert_bit_identical(hf, convert(runs.layout(layout), "qwen3_moe"))


def test_real_grouped_mlp_has_the_names_and_shapes_of_the_synthetic_layout(runs, tmp_path):
    mc = ms.CASES["qwen3_moe"]
    real = ms.launch(tmp_path, {"tp": 2, "pp": 1}, ms.grouped_mlp_metadata_worker, "qwen3_moe")
    grouped = grouped_states(runs.layout("tp2")["qwen3_moe"]["states"], mc)
    for topology, state in grouped.items():
        synthetic = sorted(
            (s.name, s.shape, s.partition_dim) for s in state.shards if ".experts." in s.name
        )
        assert real[topology.tp_rank] == synthetic


# --- bad input on real metadata ------------------------------------------------------------------


def test_missing_rank_names_the_tensor(runs):
    states = dict(runs.layout("tp2")["llama_gqa"]["states"])
    states.pop(next(t for t in states if t.tp_rank == 1))
    with pytest.raises(PlanError, match=r"model\.embed_tokens\.weight.*missing ranks: tp1 pp0"):
        convert_megatron_to_hf(states, ms.hf_config(ms.CASES["llama_gqa"]))


def test_two_ranks_claiming_the_same_shard_names_the_parameter(runs):
    cfg = ms.hf_config(ms.CASES["llama_gqa"])
    states = runs.layout("tp2")["llama_gqa"]["states"]
    plans = [plan_rank(s.shards, t, cfg) for t, s in states.items()]
    with pytest.raises(
        PlanError,
        match=r"written twice: by Megatron parameter 'embedding\.word_embeddings\.weight'",
    ):
        check_coverage([plans[0], *plans])


def test_config_contradicting_the_model_names_the_parameter(runs):
    case = ms.CASES["qwen3_qknorm"]
    states = runs.layout("tp2")["qwen3_qknorm"]["states"]
    wrong_head_dim = ms.hf_config(case)
    wrong_head_dim.head_dim = 32
    with pytest.raises(
        PlanError, match=r"'decoder\.layers\.0\.self_attention\.linear_\w+\.weight' has shape"
    ):
        convert_megatron_to_hf(states, wrong_head_dim)
    untied = ms.hf_config(case)
    untied.tie_word_embeddings = False
    with pytest.raises(PlanError, match="share_embeddings_and_output_weights=True"):
        convert_megatron_to_hf(states, untied)
