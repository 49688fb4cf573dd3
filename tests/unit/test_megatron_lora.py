"""Megatron-Bridge LoRA adapters -> HF PEFT tensors, on synthetic shards (no megatron module).

The per-rank tensors are cut from full (TP=1) Megatron tensors the way Bridge shards them
(see ``weightsync/sender/megatron/lora.py``); the expected HF tensors are computed here
independently of the library's rules (group-wise QKV slicing, gate/up halves).
"""

from __future__ import annotations

import json

import peft
import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen2ForCausalLM

from tests.support import tiny_config
from weightsync.errors import PlanError
from weightsync.manifest import VersionManifest
from weightsync.sender.megatron import (
    LoraExport,
    RankTopology,
    ShardMeta,
    convert_megatron_to_hf,
    plan_rank,
)

H, HEADS, KV, HD, FFN, VOCAB, LAYERS, R, ALPHA = 32, 4, 2, 8, 48, 64, 2, 4, 16.0
QKV = (HEADS + 2 * KV) * HD
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
PATHS = {
    "linear_qkv": "self_attention.linear_qkv",
    "linear_proj": "self_attention.linear_proj",
    "linear_fc1": "mlp.linear_fc1",
    "linear_fc2": "mlp.linear_fc2",
}


def hf_config():
    return tiny_config(
        "qwen2",
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )


# --- full Megatron tensors and Bridge's TP cut -----------------------------------------------
# kind: how TP splits it. "col": dim 0; "gated": per-rank [gate_r; up_r]; "row": dim 1;
# "rep": replicated. Adapters: A of column targets is "col" (rank dim), of row targets "row";
# every B is split like its base weight's rows ("gated" for fc1, else "col").


def full_model(seed: int, targets=TARGETS) -> dict[str, tuple[torch.Tensor, str]]:
    gen = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(shape, generator=gen) * 0.3

    out = {"embedding.word_embeddings.weight": (t(VOCAB, H), "col")}
    base = {
        "linear_qkv": ((QKV, H), "col", (R, H), "col", "col"),
        "linear_proj": ((H, HEADS * HD), "row", (R, HEADS * HD), "row", "col"),
        "linear_fc1": ((2 * FFN, H), "gated", (R, H), "col", "gated"),
        "linear_fc2": ((H, FFN), "row", (R, FFN), "row", "col"),
    }
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = (1 + t(H), "rep")
        out[p + "pre_mlp_layernorm.weight"] = (1 + t(H), "rep")
        for kind, (shape, split, a_shape, a_split, b_split) in base.items():
            wrapped = kind in targets
            stem = p + PATHS[kind] + (".to_wrap" if wrapped else "")
            out[stem + ".weight"] = (t(*shape), split)
            if kind == "linear_qkv":
                out[stem + ".bias"] = (t(QKV), "col")
            if wrapped:
                a = p + PATHS[kind] + ".adapter."
                out[a + "linear_in.weight"] = (t(*a_shape), a_split)
                out[a + "linear_out.weight"] = (t(shape[0], R), b_split)
    out["decoder.final_layernorm.weight"] = (1 + t(H), "rep")
    out["output_layer.weight"] = (t(VOCAB, H), "col")
    return out


def cut(tensor: torch.Tensor, split: str, rank: int, tp: int) -> torch.Tensor:
    if split == "rep":
        return tensor.clone()
    if split == "row":
        return tensor.chunk(tp, dim=1)[rank].clone()
    if split == "gated":
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]).clone()
    return tensor.chunk(tp, dim=0)[rank].clone()


def rank_states(full, tp: int):
    states = {}
    for rank in range(tp):
        metas, tensors = [], {}
        for name, (tensor, split) in full.items():
            local = cut(tensor, split, rank, tp)
            layer = int(name.split(".")[2]) if name.startswith("decoder.layers.") else None
            pdim = {"col": 0, "gated": 0, "row": 1}.get(split)
            meta = ShardMeta(name, 0, layer, "float32", tuple(local.shape), pdim)
            metas.append(meta)
            tensors[meta.key] = local
        states[RankTopology(tp_rank=rank, tp_size=tp)] = (metas, tensors)
    return states


def export(states, export_settings=None):
    """The offline converter with the adapter, plus rank 0's plan (for the adapter config)."""
    settings = export_settings or LoraExport("sql", ALPHA)
    topology, (metas, _) = next(iter(states.items()))
    plan = plan_rank(metas, topology, hf_config(), lora=settings)
    out = convert_megatron_to_hf(states, hf_config(), lora=settings)
    return plan, {k: v.clone() for k, v in out.items()}


# --- independent Megatron -> HF reference ----------------------------------------------------


def split_qkv(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = rows.reshape(KV, (HEADS // KV + 2) * HD, *rows.shape[1:])
    q = groups[:, : HEADS // KV * HD].reshape(-1, *rows.shape[1:])
    k = groups[:, HEADS // KV * HD : (HEADS // KV + 1) * HD].reshape(-1, *rows.shape[1:])
    v = groups[:, (HEADS // KV + 1) * HD :].reshape(-1, *rows.shape[1:])
    return q, k, v


def hf_modules(kind: str, layer: int, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Megatron-layout rows of one target -> {HF module path: rows}."""
    p = f"model.layers.{layer}."
    if kind == "linear_qkv":
        return dict(zip((p + f"self_attn.{x}_proj" for x in "qkv"), split_qkv(w), strict=True))
    if kind == "linear_fc1":
        gate, up = w.chunk(2)
        return {p + "mlp.gate_proj": gate, p + "mlp.up_proj": up}
    return {p + ("self_attn.o_proj" if kind == "linear_proj" else "mlp.down_proj"): w}


def merged_reference(full, hf_base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF weights with the Megatron adapter math ``W + alpha/r * B @ A`` applied."""
    ref = dict(hf_base)
    for layer in range(LAYERS):
        for kind in TARGETS:
            a = full[f"decoder.layers.{layer}.{PATHS[kind]}.adapter.linear_in.weight"][0]
            b = full[f"decoder.layers.{layer}.{PATHS[kind]}.adapter.linear_out.weight"][0]
            for module, delta in hf_modules(kind, layer, ALPHA / R * (b @ a)).items():
                ref[module + ".weight"] = ref[module + ".weight"] + delta
    return ref


def split_out(exported: dict[str, torch.Tensor]):
    lora = {k: v for k, v in exported.items() if k.startswith("base_model.model.")}
    base = {k: v for k, v in exported.items() if k not in lora}
    return base, lora


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
def test_exported_adapter_equals_full_adapter_math(tp):
    full = full_model(seed=1)
    plan, exported = export(rank_states(full, tp))
    _, lora = split_out(exported)
    assert set(lora) == set(plan.lora.tensor_names)
    assert len(lora) == LAYERS * 7 * 2
    for layer in range(LAYERS):
        for kind in TARGETS:
            prefix = f"decoder.layers.{layer}.{PATHS[kind]}.adapter."
            a, b = full[prefix + "linear_in.weight"][0], full[prefix + "linear_out.weight"][0]
            for module, b_rows in hf_modules(kind, layer, b).items():
                got_a = lora[f"base_model.model.{module}.lora_A.weight"]
                got_b = lora[f"base_model.model.{module}.lora_B.weight"]
                # lora_A is shared by the packed modules; lora_B is the module's rows of B.
                assert torch.equal(got_a, a)
                assert torch.equal(got_b, b_rows)
            deltas = hf_modules(kind, layer, b @ a)
            for module, delta in deltas.items():
                got = lora[f"base_model.model.{module}.lora_B.weight"]
                got = got @ lora[f"base_model.model.{module}.lora_A.weight"]
                torch.testing.assert_close(got, delta, rtol=0, atol=1e-6)


def test_tp2_export_is_bit_identical_to_tp1():
    full = full_model(seed=2)
    _, one = export(rank_states(full, 1))
    _, two = export(rank_states(full, 2))
    assert one.keys() == two.keys()
    for name in one:
        assert torch.equal(one[name], two[name]), name


def test_adapter_config_and_manifest():
    plan, _ = export(rank_states(full_model(seed=3), 2))
    config = plan.lora.config
    assert plan.lora.name == "sql"
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (R, ALPHA, "LORA")
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    VersionManifest(1, plan.manifest, plan.lora)  # every adapter tensor is announced
    shapes = {s.name: s.shape for s in plan.manifest}
    p = "base_model.model.model.layers.1."
    assert shapes[p + "self_attn.k_proj.lora_A.weight"] == (R, H)
    assert shapes[p + "self_attn.k_proj.lora_B.weight"] == (KV * HD, R)
    assert shapes[p + "self_attn.o_proj.lora_A.weight"] == (R, HEADS * HD)
    assert shapes[p + "mlp.down_proj.lora_B.weight"] == (H, R)


@pytest.mark.parametrize("tp", [1, 2])
def test_peft_loads_exported_adapter_and_matches_megatron_math(tp, tmp_path):
    full = full_model(seed=4)
    plan, exported = export(rank_states(full, tp))
    base, lora = split_out(exported)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(hf_config()).eval()
    model.load_state_dict(base, strict=True)
    reference = Qwen2ForCausalLM(hf_config()).eval()
    reference.load_state_dict(merged_reference(full, base), strict=True)

    config = {k: v for k, v in plan.lora.config.items() if k != "peft_type"}
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**config))
    result = peft.set_peft_model_state_dict(peft_model, lora)
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]

    # The saved-adapter path engines use: adapter_config.json + adapter_model.safetensors.
    (tmp_path / "adapter_config.json").write_text(plan.lora.config_json)
    save_file({k: v.contiguous() for k, v in lora.items()}, tmp_path / "adapter_model.safetensors")
    fresh = Qwen2ForCausalLM(hf_config()).eval()
    fresh.load_state_dict(base, strict=True)
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path).eval()

    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = reference(ids).logits
        got_set = peft_model(ids).logits
        got_loaded = loaded(ids).logits
        with loaded.disable_adapter():
            base_logits = loaded(ids).logits
    # PEFT adds x@A^T@B^T to x@W^T; the reference merges B@A into W first: same math, a
    # different float32 summation order (observed max diff ~1.5e-5 on logits of size ~1).
    torch.testing.assert_close(got_set, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_loaded, got_set, rtol=0, atol=1e-6)
    assert not torch.allclose(base_logits, want, atol=1e-3)  # the adapter really matters


def test_partial_targets_only_export_those():
    full = full_model(seed=6, targets=("linear_qkv", "linear_fc2"))
    plan, exported = export(rank_states(full, 2))
    _, lora = split_out(exported)
    modules = {k.split(".")[-3] for k in lora}
    assert modules == {"q_proj", "k_proj", "v_proj", "down_proj"}
    assert json.loads(plan.lora.config_json)["target_modules"] == sorted(modules)


def test_adapter_without_settings_is_an_error_naming_it():
    (metas, _), *_ = rank_states(full_model(seed=7), 1).values()
    with pytest.raises(PlanError, match=r"linear_qkv\.adapter\.linear_in\.weight.*LoraExport"):
        plan_rank(metas, RankTopology(), hf_config())


def test_models_without_adapters_plan_unchanged():
    full = full_model(seed=8, targets=())
    (metas, _), *_ = rank_states(full, 1).values()
    plan = plan_rank(metas, RankTopology(), hf_config())
    assert plan.lora is None
    assert not [s for s in plan.manifest if "lora_" in s.name]


def test_unsupported_adapter_names_and_rank_mismatch():
    (metas, _), *_ = rank_states(full_model(seed=9), 2).values()
    canonical = ShardMeta(
        "decoder.layers.0.self_attention.linear_qkv.adapter.adapter_q.linear_in.weight",
        0,
        0,
        "float32",
        (R // 2, H),
        0,
    )
    with pytest.raises(PlanError, match="adapter_q.linear_in.weight.*no rule"):
        plan_rank([*metas, canonical], RankTopology(0, 2), hf_config(), lora=LoraExport("x", 8))
    with pytest.raises(PlanError, match="LoraExport.rank=8"):
        plan_rank(metas, RankTopology(0, 2), hf_config(), lora=LoraExport("x", 8, rank=8))
    bad = [
        ShardMeta(m.name, 0, m.layer, m.dtype, (m.shape[0], R + 1), m.partition_dim)
        if m.name.endswith("linear_fc2.adapter.linear_out.weight")
        else m
        for m in metas
    ]
    with pytest.raises(PlanError, match="differ"):
        plan_rank(bad, RankTopology(0, 2), hf_config(), lora=LoraExport("x", 8))


def test_adapter_shape_contradicting_config_names_it():
    (metas, _), *_ = rank_states(full_model(seed=10), 2).values()
    bad = [
        ShardMeta(m.name, 0, m.layer, m.dtype, (m.shape[0] - HD, R), 0)
        if m.name.endswith("layers.1.self_attention.linear_qkv.adapter.linear_out.weight")
        else m
        for m in metas
    ]
    with pytest.raises(PlanError, match=r"layers\.1\.self_attention\.linear_qkv\.adapter"):
        plan_rank(bad, RankTopology(0, 2), hf_config(), lora=LoraExport("x", 8))
