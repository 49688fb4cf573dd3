"""Resolution learned from SGLang's own ``load_weights``: what it resolves, that it writes
nothing, and that it stays linear in names (up to a 48-layer, 128-expert Qwen3-MoE)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.support import tiny_config
from tests.support.sglang import build, checkpoint_specs, init_sglang
from weightsync.buckets import TensorSpec
from weightsync.errors import ManifestMismatchError, NameResolutionError

pytestmark = pytest.mark.sglang

LAYERS, EXPERTS, HIDDEN, EXPERT_INTERMEDIATE = 48, 128, 64, 16


def _resolve(model, specs):
    from weightsync.receiver.name_resolver import resolve_by_loading

    return resolve_by_loading(model, specs)


def _moe_specs(layers: int, experts: int) -> list[TensorSpec]:
    """Checkpoint names and shapes of the meta Qwen3-MoE below (per-expert, as on disk)."""
    f32 = "float32"
    specs = [
        TensorSpec("model.embed_tokens.weight", f32, (256, HIDDEN)),
        TensorSpec("model.norm.weight", f32, (HIDDEN,)),
        TensorSpec("lm_head.weight", f32, (256, HIDDEN)),
    ]
    for layer in range(layers):
        p = f"model.layers.{layer}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", f32, (HIDDEN,)),
            TensorSpec(p + "post_attention_layernorm.weight", f32, (HIDDEN,)),
            TensorSpec(p + "self_attn.q_proj.weight", f32, (64, HIDDEN)),
            TensorSpec(p + "self_attn.k_proj.weight", f32, (32, HIDDEN)),
            TensorSpec(p + "self_attn.v_proj.weight", f32, (32, HIDDEN)),
            TensorSpec(p + "self_attn.o_proj.weight", f32, (HIDDEN, 64)),
            TensorSpec(p + "self_attn.q_norm.weight", f32, (32,)),
            TensorSpec(p + "self_attn.k_norm.weight", f32, (32,)),
            TensorSpec(p + "mlp.gate.weight", f32, (experts, HIDDEN)),
        ]
        for e in range(experts):
            specs += [
                TensorSpec(p + f"mlp.experts.{e}.gate_proj.weight", f32, (16, HIDDEN)),
                TensorSpec(p + f"mlp.experts.{e}.up_proj.weight", f32, (16, HIDDEN)),
                TensorSpec(p + f"mlp.experts.{e}.down_proj.weight", f32, (HIDDEN, 16)),
            ]
    return specs


def _meta_moe(layers: int, experts: int) -> torch.nn.Module:
    init_sglang()  # its CPU shims first
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    config = tiny_config(
        "qwen3_moe",
        num_hidden_layers=layers,
        num_experts=experts,
        hidden_size=HIDDEN,
        moe_intermediate_size=EXPERT_INTERMEDIATE,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=256,
    )
    config.dtype = torch.float32
    with torch.device("meta"):  # no memory: resolution never reads or writes the weights
        return Qwen3MoeForCausalLM(config)


def _cpu_seconds_to_resolve(layers: int) -> tuple[float, dict]:
    model = _meta_moe(layers, EXPERTS)
    specs = _moe_specs(layers, EXPERTS)
    # This thread's CPU time, not wall time: the CI machine is shared.
    start = time.thread_time()
    resolved = _resolve(model, specs)
    return time.thread_time() - start, resolved


def test_large_moe_resolution_is_linear_in_names():
    """Four times the names cost about four times the time; a quadratic pass would cost 16x.

    A ratio rather than a wall-clock bound: absolute times swing with the machine's load.
    """
    assert len(_moe_specs(LAYERS, EXPERTS)) > 18_000
    small, _ = _cpu_seconds_to_resolve(LAYERS // 4)
    large, resolved = _cpu_seconds_to_resolve(LAYERS)
    assert large < 8 * small, f"48 layers took {large:.2f} s, 12 layers {small:.2f} s"
    hit = resolved[f"model.layers.47.mlp.experts.{EXPERTS - 1}.up_proj.weight"]
    assert (hit.live_name, hit.expert_id, hit.shard_id) == (
        "model.layers.47.mlp.experts.w13_weight",
        EXPERTS - 1,
        "w3",
    )
    q = resolved["model.layers.3.self_attn.q_proj.weight"]
    assert (q.live_name, q.shard_id) == ("model.layers.3.self_attn.qkv_proj.weight", "q")


def test_packing_learned_without_declarations():
    """A model that declares no packed_modules_mapping still resolves q/k/v and gate/up."""
    model, hf = build("qwen2")
    for attr in ("packed_modules_mapping", "bitsandbytes_stacked_params_mapping"):
        if attr in type(model).__dict__:
            setattr(model, attr, {})
    resolved = _resolve(model, checkpoint_specs(hf))
    k = resolved["model.layers.1.self_attn.k_proj.weight"]
    assert (k.live_name, k.shard_id) == ("model.layers.1.self_attn.qkv_proj.weight", "k")
    up = resolved["model.layers.0.mlp.up_proj.weight"]
    assert (up.live_name, up.shard_id) == ("model.layers.0.mlp.gate_up_proj.weight", 1)


def test_dry_run_writes_nothing_and_restores_loaders():
    model, hf = build("qwen3_moe")
    with torch.no_grad():  # built with torch.empty: NaNs would never compare equal
        for p in model.parameters():
            p.normal_()
    before = {
        n: (p.detach().clone(), getattr(p, "weight_loader", None))
        for n, p in model.named_parameters()
    }
    _resolve(model, checkpoint_specs(hf))
    for name, param in model.named_parameters():
        data, loader = before[name]
        assert torch.equal(param.data, data), name
        assert getattr(param, "weight_loader", None) == loader, name


def test_all_unknown_names_listed_and_mismatch_named():
    model, hf = build("llama")
    specs = checkpoint_specs(hf)
    typos = [
        TensorSpec(f"model.layers.{i}.self_attn.qkv_typo.weight", "float32", (4,)) for i in range(2)
    ]
    with pytest.raises(NameResolutionError, match=r"layers\.0\.self_attn\.qkv_typo.*layers\.1"):
        _resolve(model, [*specs, *typos])
    bad = [
        s
        if s.name != "model.layers.0.self_attn.v_proj.weight"
        else TensorSpec(s.name, "float32", (s.shape[0] - 1, s.shape[1]))
        for s in specs
    ]
    with pytest.raises(ManifestMismatchError, match=r"layers\.0\.self_attn\.v_proj"):
        _resolve(model, bad)
