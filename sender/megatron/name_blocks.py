"""The building blocks of the name templates: the mappings of each kind of layer part.

Attention (:func:`attention`; DeepSeek-V3's MLA: :func:`mla_attention`; Qwen3-Next / Qwen3.5's
gated attention and GatedDeltaNet: :func:`hybrid_attention`), MLPs (gated: :func:`dense_mlp`,
plain: :func:`plain_mlp`), MoE (:func:`moe`, :func:`shared_experts`), and the mappings before
(:data:`PRE`) and after (:data:`POST`) the layers and of MTP layers (:data:`MTP`,
:data:`QWEN3_5_MTP`). :mod:`.name_templates` puts them together per architecture.

HF names use ``{layer}`` (the global layer) and ``{expert}`` (the global expert); :data:`L` is
a decoder layer's HF prefix.
"""

from __future__ import annotations

from .name_mapping import ParamMapping
from .rules import (
    ColumnRule,
    DroppedRule,
    GatedFc1Rule,
    GroupedFc1Rule,
    GroupedFc2Rule,
    HeadSectionsRule,
    LatentDownRule,
    QKVRule,
    ReplicatedRule,
    RowRule,
    Rule,
    VocabRule,
)

L = "model.layers.{layer}."
R = ReplicatedRule
_H = ("hidden",)


def _m(megatron: str | tuple[str, ...], rule: Rule, when: str | None = None) -> ParamMapping:
    return ParamMapping((megatron,) if isinstance(megatron, str) else megatron, rule, when)


def _norm(local: str, te: str | None, hf: str) -> tuple[ParamMapping, ...]:
    """A norm's weight and optional bias; ``te`` is the TE spelling fused into the next linear."""
    names = [(f"{local}.{p}",) + ((f"{te}_{p}",) if te else ()) for p in ("weight", "bias")]
    return (
        _m(names[0], R((f"{hf}.weight",), (_H,))),
        _m(names[1], R((f"{hf}.bias",), (_H,)), "norm_bias"),
    )


def attention() -> tuple[ParamMapping, ...]:
    a = L + "self_attn."
    qkv_w = tuple(f"{a}{p}_proj.weight" for p in "qkv")
    qkv_b = tuple(f"{a}{p}_proj.bias" for p in "qkv")
    return (
        *_norm("input_layernorm", "self_attention.linear_qkv.layer_norm", L + "input_layernorm"),
        _m(
            "self_attention.linear_qkv.weight",
            QKVRule(qkv_w, (("q_rows", "hidden"), ("kv_rows", "hidden"), ("kv_rows", "hidden"))),
        ),
        _m(
            "self_attention.linear_qkv.bias",
            QKVRule(qkv_b, (("q_rows",), ("kv_rows",), ("kv_rows",))),
            "qkv_bias",
        ),
        _m(
            "self_attention.q_layernorm.weight",
            R((a + "q_norm.weight",), (("head_dim",),)),
            "qk_norm",
        ),
        _m(
            "self_attention.k_layernorm.weight",
            R((a + "k_norm.weight",), (("head_dim",),)),
            "qk_norm",
        ),
        _m(
            "self_attention.linear_proj.weight",
            RowRule((a + "o_proj.weight",), (("hidden", "q_rows"),)),
        ),
        _m("self_attention.linear_proj.bias", R((a + "o_proj.bias",), (_H,)), "o_bias"),
        *_norm("pre_mlp_layernorm", "mlp.linear_fc1.layer_norm", L + "post_attention_layernorm"),
    )


def mla_attention() -> tuple[ParamMapping, ...]:
    """megatron-core ``MLASelfAttention`` (DeepSeek-V3). Every linear but ``linear_proj`` is a
    ``ColumnParallelLinear`` in the local spec (the down projections too: megatron gathers their
    output); the up projections hold whole heads per rank, each head ``[nope | rope]`` (q) or
    ``[k_nope | v]`` (kv), as HF's ``q_b_proj`` / ``kv_b_proj``. The TE spec fuses the q / kv
    norms into the up projections (``layer_norm_weight``) and replicates the down projections."""
    a, s = L + "self_attn.", "self_attention."
    return (
        *_norm("input_layernorm", None, L + "input_layernorm"),
        _m(
            s + "linear_q_proj.weight",
            ColumnRule((a + "q_proj.weight",), (("mla_q_rows", "hidden"),)),
            "no_q_lora",
        ),
        _m(
            s + "linear_q_down_proj.weight",
            LatentDownRule((a + "q_a_proj.weight",), (("q_lora", "hidden"),)),
            "q_lora",
        ),
        _m(
            (s + "q_layernorm.weight", s + "linear_q_up_proj.layer_norm_weight"),
            R((a + "q_a_layernorm.weight",), (("q_lora",),)),
            "q_lora",
        ),
        _m(
            s + "linear_q_up_proj.weight",
            ColumnRule((a + "q_b_proj.weight",), (("mla_q_rows", "q_lora"),)),
            "q_lora",
        ),
        _m(
            s + "linear_kv_down_proj.weight",
            LatentDownRule((a + "kv_a_proj_with_mqa.weight",), (("kv_a_rows", "hidden"),)),
        ),
        _m(
            (s + "kv_layernorm.weight", s + "linear_kv_up_proj.layer_norm_weight"),
            R((a + "kv_a_layernorm.weight",), (("kv_lora",),)),
        ),
        _m(
            s + "linear_kv_up_proj.weight",
            ColumnRule((a + "kv_b_proj.weight",), (("kv_b_rows", "kv_lora"),)),
        ),
        _m(s + "linear_proj.weight", RowRule((a + "o_proj.weight",), (("hidden", "v_rows"),))),
        *_norm("pre_mlp_layernorm", "mlp.linear_fc1.layer_norm", L + "post_attention_layernorm"),
    )


def hybrid_attention(qwen3_5: bool) -> tuple[ParamMapping, ...]:
    """Qwen3-Next / Qwen3.5 layers: megatron's gated attention (``attention_output_gate``) in
    "full_attention" layers, its ``GatedDeltaNet`` in "linear_attention" ones. The TE spec
    fuses the input norm into ``linear_qkv`` or the GDN's ``in_proj``. Qwen3-Next packs the
    GDN input projection per key head (``in_proj_qkvz`` / ``in_proj_ba``); Qwen3.5 keeps
    ``in_proj_qkv`` (q, k, v each whole) and ``in_proj_z`` / ``_b`` / ``_a`` apart."""
    a, g, s = L + "self_attn.", L + "linear_attn.", "self_attention."
    full, linear = "full_attention", "linear_attention"
    qkv = (("lin_k_dim", 0), ("lin_k_dim", 0), ("lin_v_per_k", 0))
    if qwen3_5:
        in_proj = HeadSectionsRule(
            tuple(f"{g}in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
            (("lin_conv", "hidden"), ("lin_v_rows", "hidden")) + (("lin_v_heads", "hidden"),) * 2,
            sections=qkv + (("lin_v_per_k", 1), ("lin_heads_per_k", 2), ("lin_heads_per_k", 3)),
        )
    else:
        in_proj = HeadSectionsRule(
            (g + "in_proj_qkvz.weight", g + "in_proj_ba.weight"),
            (("lin_qkvz", "hidden"), ("lin_ba", "hidden")),
            sections=qkv + (("lin_v_per_k", 0),) + (("lin_heads_per_k", 1),) * 2,
            interleaved=True,
        )
    return (
        _m(
            (
                "input_layernorm.weight",
                s + "linear_qkv.layer_norm_weight",
                s + "in_proj.layer_norm_weight",
            ),
            R((L + "input_layernorm.weight",), (_H,)),
        ),
        _m(
            s + "linear_qkv.weight",
            QKVRule(
                tuple(f"{a}{p}_proj.weight" for p in "qkv"),
                (("q_gate_rows", "hidden"), ("kv_rows", "hidden"), ("kv_rows", "hidden")),
                output_gate=True,
            ),
            full,
        ),
        _m(s + "q_layernorm.weight", R((a + "q_norm.weight",), (("head_dim",),)), full),
        _m(s + "k_layernorm.weight", R((a + "k_norm.weight",), (("head_dim",),)), full),
        _m(
            s + "linear_proj.weight",
            RowRule((a + "o_proj.weight",), (("hidden", "q_rows"),)),
            full,
        ),
        _m(s + "in_proj.weight", in_proj, linear),
        _m(
            s + "conv1d.weight",
            HeadSectionsRule(
                (g + "conv1d.weight",), (("lin_conv", 1, "lin_conv_kernel"),), sections=qkv
            ),
            linear,
        ),
        _m(s + "dt_bias", ColumnRule((g + "dt_bias",), (("lin_v_heads",),)), linear),
        _m(s + "A_log", ColumnRule((g + "A_log",), (("lin_v_heads",),)), linear),
        _m(s + "out_norm.weight", R((g + "norm.weight",), (("lin_v_dim",),)), linear),
        _m(
            s + "out_proj.weight",
            RowRule((g + "out_proj.weight",), (("hidden", "lin_v_rows"),)),
            linear,
        ),
        *_norm("pre_mlp_layernorm", "mlp.linear_fc1.layer_norm", L + "post_attention_layernorm"),
    )


def _gated_mlp(
    fc1: tuple[str, ...],
    fc2: tuple[str, ...],
    hf: str,
    names: tuple[str, str, str],
    ffn: str,
    when: str | None,
) -> tuple[ParamMapping, ...]:
    """Gated MLP weights: Megatron ``fc1`` / ``fc2`` spellings -> ``{hf}.{gate,up,down}.weight``."""
    gate, up, down = (f"{hf}.{n}.weight" for n in names)
    return (
        _m(fc1, GatedFc1Rule((gate, up), ((ffn, "hidden"), (ffn, "hidden"))), when),
        _m(fc2, RowRule((down,), (("hidden", ffn),)), when),
    )


def dense_mlp(hf: str, names: tuple[str, str, str]) -> tuple[ParamMapping, ...]:
    gate, up, down = (f"{hf}.{n}" for n in names)
    return (
        *_gated_mlp(
            ("mlp.linear_fc1.weight",), ("mlp.linear_fc2.weight",), hf, names, "ffn", "dense_layer"
        ),
        _m(
            "mlp.linear_fc1.bias",
            GatedFc1Rule((gate + ".bias", up + ".bias"), (("ffn",),) * 2),
            "mlp_bias",
        ),
        _m("mlp.linear_fc2.bias", R((down + ".bias",), (_H,)), "mlp_bias"),
    )


def moe(hf: str, names: tuple[str, str, str]) -> tuple[ParamMapping, ...]:
    """Router, expert bias, experts (SequentialMLP / TEGroupedMLP / legacy GroupedMLP)."""
    gate, up, down = (f"{hf}.experts.{{expert}}.{n}.weight" for n in names)
    fc1 = (
        "mlp.experts.local_experts.{expert}.linear_fc1.weight",
        "mlp.experts.linear_fc1.weight{expert}",
    )
    fc2 = (
        "mlp.experts.local_experts.{expert}.linear_fc2.weight",
        "mlp.experts.linear_fc2.weight{expert}",
    )
    return (
        _m("mlp.router.weight", R((f"{hf}.gate.weight",), (("experts", "hidden"),)), "moe_layer"),
        _m(
            "mlp.router.expert_bias",
            R((f"{hf}.gate.e_score_correction_bias",), (("experts",),), dtype="float32"),
            "expert_bias",
        ),
        *_gated_mlp(fc1, fc2, f"{hf}.experts.{{expert}}", names, "moe_ffn", "moe_layer"),
        _m(
            "mlp.experts.weight1",
            GroupedFc1Rule((gate, up), (("moe_ffn", "hidden"),) * 2),
            "moe_layer",
        ),
        _m("mlp.experts.weight2", GroupedFc2Rule((down,), (("hidden", "moe_ffn"),)), "moe_layer"),
    )


def shared_experts(hf: str, gate: str | None) -> tuple[ParamMapping, ...]:
    """``SharedExpertMLP`` (dense TP) and its optional sigmoid gate ``[1, hidden]``."""
    s = "mlp.shared_experts."
    out = _gated_mlp(
        (s + "linear_fc1.weight",),
        (s + "linear_fc2.weight",),
        hf,
        LLAMA_MLP,
        "shared_ffn",
        "shared_expert",
    )
    if gate is not None:
        out += (_m(s + "gate_weight", R((gate,), ((1, "hidden"),)), "shared_expert_gate"),)
    return out


def plain_mlp(hf: str) -> tuple[ParamMapping, ...]:
    """A non-gated MLP with biases (StarCoder2's ``{hf}.c_fc`` / ``{hf}.c_proj``)."""
    return (
        _m("mlp.linear_fc1.weight", ColumnRule((hf + ".c_fc.weight",), (("ffn", "hidden"),))),
        _m("mlp.linear_fc1.bias", ColumnRule((hf + ".c_fc.bias",), (("ffn",),)), "mlp_bias"),
        _m("mlp.linear_fc2.weight", RowRule((hf + ".c_proj.weight",), (("hidden", "ffn"),))),
        _m("mlp.linear_fc2.bias", R((hf + ".c_proj.bias",), (_H,)), "mlp_bias"),
    )


LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")
MTP = (  # GLM-4.5 / DeepSeek-V3 checkpoint names (vLLM's *_mtp models read these)
    _m("enorm.weight", R((L + "enorm.weight",), (_H,))),
    _m("hnorm.weight", R((L + "hnorm.weight",), (_H,))),
    _m("eh_proj.weight", ColumnRule((L + "eh_proj.weight",), (("hidden", "hidden_x2"),))),
    _m("final_layernorm.weight", R((L + "shared_head.norm.weight",), (_H,))),
)
# The last stage keeps a synchronized copy of the word embeddings when it runs MTP layers.
PRE = (
    _m(
        "embedding.word_embeddings.weight",
        VocabRule(("model.embed_tokens.weight",), first_stage_only=True),
    ),
)
POST = (
    *_norm("decoder.final_layernorm", None, "model.norm"),
    _m("output_layer.weight", VocabRule(("lm_head.weight",)), "untied"),
    _m(
        "output_layer.weight",
        DroppedRule(reason="tied embeddings: the HF model reads lm_head from embed_tokens"),
        "tied",
    ),
)
QWEN3_5_MTP = (  # Qwen3.5 checkpoint names (vLLM's Qwen3_5MTP, SGLang's Qwen3_5ForCausalLMMTP)
    _m("enorm.weight", R(("mtp.pre_fc_norm_embedding.weight",), (_H,))),
    _m("hnorm.weight", R(("mtp.pre_fc_norm_hidden.weight",), (_H,))),
    _m("eh_proj.weight", ColumnRule(("mtp.fc.weight",), (("hidden", "hidden_x2"),))),
    _m("final_layernorm.weight", R(("mtp.norm.weight",), (_H,))),
)
