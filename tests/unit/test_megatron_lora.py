"""Megatron-Bridge LoRA adapters -> HF PEFT tensors, on synthetic shards (no megatron module).

The per-rank tensors are cut from full (TP=1) Megatron tensors the way Bridge shards them
(see ``weightsync/sender/megatron/lora_export.py``); the expected HF tensors are computed here
independently of the library's rules (group-wise QKV slicing, gate/up halves).

Qwen3.5 (gated full attention and gated delta net layers): the reference merges
``alpha/r * B @ A`` into the Megatron base weights and converts the merged model with the base
conversion (checked against megatron-core's modules in
``tests/integration/test_megatron_qwen3_next.py``); transformers + PEFT must give its logits.
vLLM and SGLang cannot run a gated delta net on CPU (Triton kernels), so no engine serves it here.
"""

from __future__ import annotations

import json
import re

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
# "rep": replicated; a tuple of row counts: sections, each split on dim 0 (a gated delta net's
# in_proj / conv1d: rank r holds [q_r; k_r; v_r; ...]). Adapters: A of column targets is "col"
# (rank dim), of row targets "row"; every B is split like its base weight's rows ("gated" for
# fc1, the sections for in_proj, else "col").


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
        split = (tensor.shape[0] // 2,) * 2
    if isinstance(split, tuple):
        return torch.cat([s.chunk(tp)[rank] for s in tensor.split(split)]).clone()
    return tensor.chunk(tp, dim=0)[rank].clone()


def rank_states(full, tp: int):
    states = {}
    for rank in range(tp):
        metas, tensors = [], {}
        for name, (tensor, split) in full.items():
            local = cut(tensor, split, rank, tp)
            layer = int(name.split(".")[2]) if name.startswith("decoder.layers.") else None
            pdim = 0 if isinstance(split, tuple) else {"col": 0, "gated": 0, "row": 1}.get(split)
            meta = ShardMeta(name, 0, layer, "float32", tuple(local.shape), pdim)
            metas.append(meta)
            tensors[meta.key] = local
        states[RankTopology(tp_rank=rank, tp_size=tp)] = (metas, tensors)
    return states


def export(states, export_settings=None, config=None):
    """The offline converter with the adapter, plus rank 0's plan (for the adapter config)."""
    settings = export_settings or LoraExport("sql", ALPHA)
    config = config or hf_config()
    topology, (metas, _) = next(iter(states.items()))
    plan = plan_rank(metas, topology, config, lora=settings)
    out = convert_megatron_to_hf(states, config, lora=settings)
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


# --- Qwen3.5: gated full attention + gated delta net (GDN) layers ------------------------------

Q35_HEADS, Q35_KV, Q35_HD = 4, 2, 16
K_HEADS, V_HEADS, K_DIM, V_DIM, CONV = 2, 4, 32, 32, 4
Q35_PATHS = {**PATHS, "in_proj": "self_attention.in_proj", "out_proj": "self_attention.out_proj"}
GDN_QKV = (K_HEADS * K_DIM, K_HEADS * K_DIM, V_HEADS * V_DIM)
"""Rows of the GDN's q, k, v sections (``conv1d``; ``in_proj`` adds z, beta, alpha)."""
IN_PROJ = (*GDN_QKV, V_HEADS * V_DIM, V_HEADS, V_HEADS)


def qwen3_5_config():
    """Layer 0 a gated delta net, layer 1 gated full attention (two query groups)."""
    from tests.sweeps.archs import _HYBRID, Arch
    from tests.sweeps.archs import tiny_config as sweep_config

    overrides = dict(
        hidden_size=H,
        intermediate_size=FFN,
        vocab_size=VOCAB,
        num_attention_heads=Q35_HEADS,
        num_key_value_heads=Q35_KV,
        head_dim=Q35_HD,
        linear_num_key_heads=K_HEADS,
        linear_num_value_heads=V_HEADS,
        linear_key_head_dim=K_DIM,
        linear_value_head_dim=V_DIM,
        linear_conv_kernel_dim=CONV,
    )
    return sweep_config(Arch("qwen3_5_text", {**_HYBRID, **overrides}))


def qwen3_5_model(seed: int) -> dict[str, tuple[torch.Tensor, object]]:
    """Full Megatron tensors of a Qwen3.5 model with Bridge LoRA on every target kind it has
    (see :func:`full_model`)."""
    gen = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(shape, generator=gen) * 0.3

    qkv = Q35_KV * (2 * Q35_HEADS // Q35_KV + 2) * Q35_HD  # q and gate rows per group, k, v
    mixers = {  # kind: (base shape, base split, A split, B split), A is [R, base columns]
        0: {
            "in_proj": ((sum(IN_PROJ), H), IN_PROJ, "col", IN_PROJ),
            "out_proj": ((H, V_HEADS * V_DIM), "row", "row", "col"),
        },
        1: {
            "linear_qkv": ((qkv, H), "col", "col", "col"),
            "linear_proj": ((H, Q35_HEADS * Q35_HD), "row", "row", "col"),
        },
    }
    mlp = {
        "linear_fc1": ((2 * FFN, H), "gated", "col", "gated"),
        "linear_fc2": ((H, FFN), "row", "row", "col"),
    }
    out = {"embedding.word_embeddings.weight": (t(VOCAB, H), "col")}
    for i, mixer in mixers.items():
        p = f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = (t(H), "rep")
        s = p + "self_attention."
        if i == 0:
            out[s + "conv1d.weight"] = (t(sum(GDN_QKV), 1, CONV), GDN_QKV)
            out[s + "dt_bias"] = (t(V_HEADS), "col")
            out[s + "A_log"] = (t(V_HEADS), "col")
            out[s + "out_norm.weight"] = (t(V_DIM), "rep")
        else:
            out[s + "q_layernorm.weight"] = (t(Q35_HD), "rep")
            out[s + "k_layernorm.weight"] = (t(Q35_HD), "rep")
        out[p + "pre_mlp_layernorm.weight"] = (t(H), "rep")
        for kind, (shape, split, a_split, b_split) in {**mixer, **mlp}.items():
            out[p + Q35_PATHS[kind] + ".to_wrap.weight"] = (t(*shape), split)
            a = p + Q35_PATHS[kind] + ".adapter."
            out[a + "linear_in.weight"] = (t(R, shape[1]), a_split)
            out[a + "linear_out.weight"] = (t(shape[0], R), b_split)
    out["decoder.final_layernorm.weight"] = (t(H), "rep")
    out["output_layer.weight"] = (t(VOCAB, H), "col")
    return out


def merged_megatron(full) -> dict[str, tuple[torch.Tensor, object]]:
    """The adapter-free Megatron model with Bridge's ``W + alpha/r * B @ A`` merged in."""
    merged = {}
    for name, (tensor, split) in full.items():
        if ".adapter." in name:
            continue
        if ".to_wrap." in name:
            module = name.removesuffix(".to_wrap.weight")
            a = full[module + ".adapter.linear_in.weight"][0]
            b = full[module + ".adapter.linear_out.weight"][0]
            name, tensor = module + ".weight", tensor + ALPHA / R * (b @ a)
        merged[name] = (tensor, split)
    return merged


@pytest.fixture(scope="module")
def qwen3_5_tp1():
    full = qwen3_5_model(seed=11)
    return full, export(rank_states(full, 1), config=qwen3_5_config())


def test_qwen3_5_adapter_covers_gated_attention_gdn_and_mlp(qwen3_5_tp1):
    _, (plan, exported) = qwen3_5_tp1
    _, lora = split_out(exported)
    assert set(lora) == set(plan.lora.tensor_names)
    attn, gdn = ["q", "k", "v", "o"], ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
    assert plan.lora.config["target_modules"] == sorted(
        [f"{x}_proj" for x in attn] + [*gdn, "out_proj", "gate_proj", "up_proj", "down_proj"]
    )
    shapes = {s.name: s.shape for s in plan.manifest}
    p = "base_model.model.model.layers."
    # q_proj carries each head's query and output-gate rows.
    assert shapes[p + "1.self_attn.q_proj.lora_B.weight"] == (2 * Q35_HEADS * Q35_HD, R)
    assert shapes[p + "0.linear_attn.in_proj_qkv.lora_B.weight"] == (sum(GDN_QKV), R)
    assert shapes[p + "0.linear_attn.in_proj_b.lora_B.weight"] == (V_HEADS, R)
    assert shapes[p + "0.linear_attn.out_proj.lora_A.weight"] == (R, V_HEADS * V_DIM)
    assert not [n for n in lora if ".0.self_attn." in n or ".1.linear_attn." in n]


def test_qwen3_5_tp2_export_is_bit_identical_to_tp1(qwen3_5_tp1):
    full, (_, one) = qwen3_5_tp1
    _, two = export(rank_states(full, 2), config=qwen3_5_config())
    assert one.keys() == two.keys()
    for name in one:
        assert torch.equal(one[name], two[name]), name


def test_qwen3_5_peft_adapter_matches_merged_megatron_weights(qwen3_5_tp1):
    from transformers import Qwen3_5ForCausalLM

    full, (plan, exported) = qwen3_5_tp1
    base, lora = split_out(exported)
    config = qwen3_5_config()
    model = Qwen3_5ForCausalLM(config).eval()
    model.load_state_dict(base, strict=True)
    reference = Qwen3_5ForCausalLM(config).eval()
    merged = convert_megatron_to_hf(rank_states(merged_megatron(full), 1), config)
    reference.load_state_dict(merged, strict=True)

    settings = {k: v for k, v in plan.lora.config.items() if k != "peft_type"}
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**settings)).eval()
    result = peft.set_peft_model_state_dict(peft_model, lora)
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]

    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        want = reference(ids).logits
        got = peft_model(ids).logits
        with peft_model.disable_adapter():
            base_logits = peft_model(ids).logits
    # Same math, different float32 summation order (see the Qwen2 test above).
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(base_logits, want, atol=1e-3)  # the adapter really matters

    # The comparison sees the output gate's row layout: lora_B with each head's query and gate
    # rows swapped gives other logits.
    q_b = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    swapped = lora[q_b].reshape(Q35_HEADS, 2, Q35_HD, R).flip(1).reshape(-1, R)
    peft.set_peft_model_state_dict(peft_model, {**lora, q_b: swapped})
    with torch.no_grad():
        assert not torch.allclose(peft_model(ids).logits, want, atol=1e-3)


def test_qwen3_5_unsupported_adapters_are_refused_naming_them():
    (metas, _), *_ = rank_states(qwen3_5_model(seed=13), 1).values()
    unsupported = (  # Bridge wraps these when target_modules names them; no HF PEFT rule here
        "mtp.layers.0.transformer_layer.self_attention.linear_qkv",
        "decoder.layers.1.mlp.shared_experts.linear_fc1",
    )
    for module in unsupported:
        name = module + ".adapter.linear_in.weight"
        extra = ShardMeta(name, 0, 2 if module.startswith("mtp") else 1, "float32", (R, H), 0)
        with pytest.raises(PlanError, match=re.escape(repr(name)) + ".*no rule"):
            plan_rank([*metas, extra], RankTopology(), qwen3_5_config(), lora=LoraExport("x", 8))
    gdn_lora_on_attention_layer = ShardMeta(
        "decoder.layers.1.self_attention.in_proj.adapter.linear_in.weight",
        0,
        1,
        "float32",
        (R, H),
        0,
    )
    with pytest.raises(PlanError, match=r"layers\.1\.self_attention\.in_proj.*no HF counterpart"):
        plan_rank(
            [*metas, gdn_lora_on_attention_layer],
            RankTopology(),
            qwen3_5_config(),
            lora=LoraExport("x", 8),
        )
