"""HF tensor names and shapes from a config alone, checked against transformers' own models
(built on the meta device: shapes without memory) and against published parameter counts."""

from __future__ import annotations

import pytest
import torch
import transformers

from weightsync.errors import ConfigError
from weightsync.model_shapes import PRESETS, model_tensors, total_params

TINY = {
    "llama": dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ),
    "qwen2": dict(
        model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, decoder_sparse_step=2,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
    ),
    "mixtral": dict(
        model_type="mixtral", vocab_size=256, hidden_size=64, intermediate_size=96,
        num_local_experts=4, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ),
}  # fmt: skip


def _meta_state(cfg: dict) -> dict[str, tuple[int, ...]]:
    conf = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(conf)
    state = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        del state["lm_head.weight"]  # the same tensor as the embedding: engines load it once
    if cfg["model_type"] == "mixtral":  # transformers 5 renames it in memory; checkpoints do not
        state = {n.replace(".mlp.", ".block_sparse_moe."): s for n, s in state.items()}
    return state


@pytest.mark.parametrize("arch", sorted(TINY))
def test_shapes_match_transformers_models(arch):
    cfg = TINY[arch]
    ours = {t.name: t.shape for t in model_tensors(cfg)}
    theirs = _meta_state(cfg)
    # transformers 5 fuses experts in memory (experts.gate_up_proj); checkpoints and engines
    # name them one by one, as we do: compare everything else by name, experts by count.
    fused = {n for n in theirs if ".experts." in n}
    assert {n: s for n, s in ours.items() if ".experts." not in n} == {
        n: s for n, s in theirs.items() if n not in fused
    }
    count = {n: torch.Size(s).numel() for n, s in theirs.items()}
    assert sum(torch.Size(s).numel() for s in ours.values()) == sum(count.values())


def test_presets_have_their_published_sizes():
    billions = {k: total_params(model_tensors(cfg)) / 1e9 for k, cfg in PRESETS.items()}
    assert billions["deepseek-v3"] == pytest.approx(671.0, abs=0.1)  # without its MTP layer
    assert billions["qwen3-235b-a22b"] == pytest.approx(235.1, abs=0.1)
    assert billions["kimi-k2"] == pytest.approx(1026.4, abs=0.1)


def test_fp8_is_one_byte_per_linear_weight_plus_block_scales():
    cfg = TINY["deepseek_v3"]
    bf16 = {t.name: t for t in model_tensors(cfg)}
    fp8 = {t.name: t for t in model_tensors(cfg, fp8=True)}
    q = "model.layers.1.self_attn.q_b_proj"
    assert fp8[f"{q}.weight"].dtype == "float8_e4m3fn"
    assert fp8[f"{q}.weight"].nbytes * 2 == bf16[f"{q}.weight"].nbytes
    assert fp8[f"{q}.weight_scale_inv"].shape == (1, 1)  # 64 x 24: one 128 x 128 block
    assert fp8[f"{q}.weight_scale_inv"].scale_of == f"{q}.weight"
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"):
        assert fp8[kept] == bf16[kept]
    assert fp8["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "float32"


def test_bad_configs_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        model_tensors({"model_type": "gpt2"})
    with pytest.raises(ConfigError, match="hidden_size=0 must be a positive integer"):
        model_tensors({**TINY["llama"], "hidden_size": 0})
    with pytest.raises(ConfigError, match="kv_lora_rank is missing"):
        model_tensors({k: v for k, v in TINY["deepseek_v3"].items() if k != "kv_lora_rank"})
