"""DeepSeek-V3 from megatron-core 0.16.1 on CPU: MLA (with and without ``q_lora_rank``), the
dense first layer, MoE with a shared expert and the routing bias, and an MTP layer, converted by
our Megatron rules, published through a real sender and received by transformers'
``DeepseekV3ForCausalLM`` (``TorchReceiver``).

The reference is transformers' own ``from_pretrained`` of the converted checkpoint: the received
model must equal it bit for bit, and its logits must equal megatron's. SGLang's DeepSeek classes
get the same tensors in tests/sglang/test_deepseek_versions.py (vLLM on CPU cannot build
DeepSeek: its MLA kernel).
"""

from __future__ import annotations

import pytest
import torch

from tests.support import megatron as ms
from weightsync.errors import PlanError
from weightsync.sender.megatron import LocalShards, ShardMeta, convert_megatron_to_hf

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")
pytestmark = pytest.mark.megatron

CASES = [c.name for c in ms.MLA_CASES]


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    """Both cases at TP=1 (one gloo launch): shards and megatron's logits."""
    return ms.launch(
        tmp_path_factory.mktemp("tp1"), {"tp": 1, "pp": 1}, ms.collect_worker, CASES, True, True
    )[0]


def convert(run: dict, case: str, **kwargs) -> dict[str, torch.Tensor]:
    return convert_megatron_to_hf(
        run[case]["states"], ms.hf_config(ms.CASE_BY_NAME[case]), **kwargs
    )


@pytest.mark.parametrize("case", CASES)
def test_converted_checkpoint_loads_and_gives_megatron_logits(tp1, case, tmp_path):
    mc = ms.CASE_BY_NAME[case]
    hf = convert(tp1, case, export_mtp=False)  # transformers has no MTP layers
    attention = {n.split(".self_attn.")[1] for n in hf if n.startswith("model.layers.0.self_attn.")}
    q = {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"}
    assert attention == {
        *(q if mc.q_lora_rank else {"q_proj.weight"}),
        "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight",
        "kv_b_proj.weight",
        "o_proj.weight",
    }
    assert "model.layers.0.mlp.gate_proj.weight" in hf  # first_k_dense_replace=1
    assert hf["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in hf
    model, info = ms.hf_model(mc, hf, tmp_path)
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model(ms.input_ids(mc)).logits
    torch.testing.assert_close(logits, tp1[case]["logits"], rtol=0, atol=2e-5)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """Both cases at TP=2 (expert TP 2): the up projections split by head, the down
    projections by rows (local spec: ``ColumnParallelLinear``, output gathered)."""
    return ms.launch(
        tmp_path_factory.mktemp("tp2"), {"tp": 2, "pp": 1}, ms.collect_worker, CASES, True, True
    )[0]


@pytest.mark.parametrize("case", CASES)
def test_tp2_converts_bit_identical_to_tp1_and_gives_megatron_tp2_logits(tp1, tp2, case, tmp_path):
    got, want = convert(tp2, case), convert(tp1, case)
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"{name} differs"
    mc = ms.CASE_BY_NAME[case]
    model, _ = ms.hf_model(mc, convert(tp2, case, export_mtp=False), tmp_path)
    with torch.no_grad():
        logits = model(ms.input_ids(mc)).logits
    torch.testing.assert_close(logits, tp2[case]["logits"], rtol=0, atol=2e-5)


_TE_NAMES = {
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}
_DOWN = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")


def te_states(states: dict, case: ms.ModelCase) -> dict:
    """TP=2 shards laid out as megatron-core's TE MLA spec holds them.

    TransformerEngine cannot run on CPU, so the layout is built from the TE spec's definition
    (``get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True)``): the q / kv
    norms fused into the up projections, the dense layers' pre-MLP norm fused into fc1, and the
    down projections ``TELinear(parallel_mode="duplicated")``: every rank holds them whole.
    """
    by_rank = {t.tp_rank: s for t, s in states.items()}
    out = {}
    for topology, state in states.items():
        shards, tensors = [], {}
        for shard in state.shards:
            name, tensor, dim = shard.name, state.tensors[shard.key], shard.partition_dim
            for local, te in _TE_NAMES.items():
                name = name.replace(local, te)
            # dense: the first_k_dense_replace layers (the MTP layer is MoE)
            if shard.layer is not None and shard.layer < min(case.moe_layers):
                name = name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
            if name.endswith(_DOWN):
                tensor = torch.cat([by_rank[r].tensors[shard.key] for r in sorted(by_rank)])
                dim = None
            meta = replaced(shard, name=name, shape=tuple(tensor.shape), partition_dim=dim)
            shards.append(meta)
            tensors[meta.key] = tensor
        out[topology] = LocalShards(topology, tuple(shards), tensors, state.tied_embeddings)
    return out


def replaced(shard: ShardMeta, **changes) -> ShardMeta:
    return ShardMeta(**{**shard.__dict__, **changes})


@pytest.mark.parametrize("case", CASES)
def test_te_spec_layout_converts_like_the_local_spec(tp1, tp2, case):
    mc = ms.CASE_BY_NAME[case]
    te = te_states(tp2[case]["states"], mc)
    names = {s.name for st in te.values() for s in st.shards}
    assert "decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight" in names
    got = convert_megatron_to_hf(te, ms.hf_config(mc))
    want = convert(tp1, case)
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"{name} differs"


def test_mtp_layer_exports_under_deepseek_checkpoint_names(tp1):
    """DeepSeek-V3 checkpoints name MTP layer i ``model.layers.{num_hidden_layers + i}``; its
    transformer layer is an MLA + MoE layer like the others."""
    hf = convert(tp1, "deepseek_v3")
    mtp = {k.removeprefix("model.layers.4.") for k in hf if k.startswith("model.layers.4.")}
    layer = {k.removeprefix("model.layers.3.") for k in hf if k.startswith("model.layers.3.")}
    assert mtp - layer == {f"{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm")}
    assert layer <= mtp
    assert hf["model.layers.4.eh_proj.weight"].shape == (128, 256)


def test_published_versions_land_in_transformers_deepseek_like_from_pretrained(tmp_path, sock_dir):
    """TP=2 ranks publish two versions through a real sender into a transformers
    ``DeepseekV3ForCausalLM`` (``TorchReceiver``); after each, every parameter and buffer equals
    ``from_pretrained`` of that version's converted checkpoint."""

    import transformers

    from weightsync.receiver import TorchReceiver
    from weightsync.sender.daemon import Sender

    case = "deepseek_v3"
    mc = ms.CASE_BY_NAME[case]
    config = ms.hf_config(mc)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=64 * 1024) as sender:
        receiver = TorchReceiver(model, sender.address, receiver_id="hf")
        with ms.held_versions(receiver, model, ms.VERSIONS) as held:
            # cuda, host_ids, versions, export_mtp (transformers has no MTP layers)
            extra = (False, None, ms.VERSIONS, False)
            states = ms.launch(
                tmp_path, {"tp": 2, "pp": 1}, ms.publish_worker, case, sender.address, *extra
            )[0]
    for version, state in enumerate(states):
        hf = convert_megatron_to_hf(state, config, export_mtp=False)
        reference, _ = ms.hf_model(mc, hf, tmp_path / f"v{version + 1}")
        want = reference.state_dict()
        assert sorted(held[version]) == sorted(want)
        for name, tensor in want.items():
            assert torch.equal(held[version][name], tensor), f"version {version + 1}: {name}"


def test_config_disagreeing_with_the_megatron_mla_names_the_parameter(tp1):
    states = tp1["deepseek_v3"]["states"]
    no_q_lora = ms.hf_config(ms.CASE_BY_NAME["deepseek_v3_no_q_lora"])
    with pytest.raises(
        PlanError, match=r"'decoder\.layers\.0\.self_attention\.linear_q_down_proj\.weight' has no"
    ):
        convert_megatron_to_hf(states, no_q_lora)
    biased = ms.hf_config(ms.CASE_BY_NAME["deepseek_v3"])
    biased.attention_bias = True
    with pytest.raises(PlanError, match="attention_bias=True"):
        convert_megatron_to_hf(states, biased)
