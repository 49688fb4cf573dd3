"""Per-architecture name templates: which rule turns which Megatron parameter into which HF tensors.

Data only (each architecture's config reader is in :mod:`.dims`, the lookup by Megatron name in
:mod:`.name_table`). Megatron names are templates
relative to the chunk (``{layer}`` = the chunk-local layer index in the name, ``{expert}`` = the
local expert index); HF names use the global layer and global expert. Each mapping lists every
Megatron spelling of the same tensor:

- local spec (``get_gpt_layer_local_spec``): ``input_layernorm.weight``,
  ``pre_mlp_layernorm.weight``, ``mlp.experts.local_experts.{expert}.linear_fc1.weight``
  (``SequentialMLP``), ``mlp.experts.weight1`` / ``weight2`` (legacy ``GroupedMLP``);
- TE spec (``get_gpt_layer_with_transformer_engine_spec``): the layer norms are fused into the
  next linear (``self_attention.linear_qkv.layer_norm_weight``,
  ``mlp.linear_fc1.layer_norm_weight``: megatron's own ``sharded_state_dict_keys_map`` of the
  local spec says so) except before MoE, where ``pre_mlp_layernorm`` stays;
  ``TEGroupedMLP`` names experts ``mlp.experts.linear_fc1.weight{expert}``.

Every Megatron parameter must match exactly one mapping whose condition holds (unknown names
are errors); tensors deliberately not sent are :class:`DroppedRule` rows, visible here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from weightsync.errors import PlanError

from .dims import (
    CONDITIONS,
    ModelDims,
    deepseek_v3_dims,
    glm4_moe_dims,
    llama_dims,
    mixtral_dims,
    qwen2_dims,
    qwen2_moe_dims,
    qwen3_5_dims,
    qwen3_dims,
    qwen3_moe_dims,
    qwen3_next_dims,
    starcoder2_dims,
)
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


@dataclass(frozen=True)
class ParamMapping:
    megatron: tuple[str, ...]
    """Megatron name templates (all spellings of this tensor)."""
    rule: Rule
    when: str | None = None
    """A :data:`~weightsync.sender.megatron.dims.CONDITIONS` name; the mapping applies only
    where it holds for the HF config (and layer)."""

    def __post_init__(self) -> None:
        if self.when is not None and self.when not in CONDITIONS:
            raise PlanError(f"mapping {self.megatron[0]!r}: unknown condition {self.when!r}")

    @property
    def is_expert(self) -> bool:
        """Expert params are split over expert-TP and replicated over expert-DP."""
        return any("{expert}" in m or ".experts.weight" in m for m in self.megatron)


@dataclass(frozen=True)
class Architecture:
    model_types: tuple[str, ...]
    read_dims: Callable[[object], ModelDims]
    pre: tuple[ParamMapping, ...]
    """Before the layers (embedding), in HF manifest order."""
    layer: tuple[ParamMapping, ...]
    """Per decoder layer (``decoder.layers.{layer}.`` is implied), in HF manifest order."""
    post: tuple[ParamMapping, ...]
    """After the layers (final norm, output layer)."""
    mtp: tuple[ParamMapping, ...] = ()
    """MTP-only tensors (``mtp.layers.{layer}.`` implied); the MTP layer's
    ``transformer_layer`` uses the ``layer`` mappings. Empty: the architecture has no MTP."""

    def mappings(self) -> tuple[tuple[str, ParamMapping], ...]:
        """Every (full Megatron template, mapping)."""
        out = [(m, p) for p in self.pre + self.post for m in p.megatron]
        out += [("decoder.layers.{layer}." + m, p) for p in self.layer for m in p.megatron]
        if self.mtp:
            out += [("mtp.layers.{layer}." + m, p) for p in self.mtp for m in p.megatron]
            mtp_layer = "mtp.layers.{layer}.transformer_layer."
            out += [(mtp_layer + m, p) for p in self.layer for m in p.megatron]
        return tuple(out)


# --- building blocks -------------------------------------------------------------------------

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


def _attention() -> tuple[ParamMapping, ...]:
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


def _mla_attention() -> tuple[ParamMapping, ...]:
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


def _hybrid_attention(qwen3_5: bool) -> tuple[ParamMapping, ...]:
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


def _dense_mlp(hf: str, names: tuple[str, str, str]) -> tuple[ParamMapping, ...]:
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


def _moe(hf: str, names: tuple[str, str, str]) -> tuple[ParamMapping, ...]:
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


def _shared_experts(hf: str, gate: str | None) -> tuple[ParamMapping, ...]:
    """``SharedExpertMLP`` (dense TP) and its optional sigmoid gate ``[1, hidden]``."""
    s = "mlp.shared_experts."
    out = _gated_mlp(
        (s + "linear_fc1.weight",),
        (s + "linear_fc2.weight",),
        hf,
        _LLAMA_MLP,
        "shared_ffn",
        "shared_expert",
    )
    if gate is not None:
        out += (_m(s + "gate_weight", R((gate,), ((1, "hidden"),)), "shared_expert_gate"),)
    return out


_LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")
_MTP = (  # GLM-4.5 / DeepSeek-V3 checkpoint names (vLLM's *_mtp models read these)
    _m("enorm.weight", R((L + "enorm.weight",), (_H,))),
    _m("hnorm.weight", R((L + "hnorm.weight",), (_H,))),
    _m("eh_proj.weight", ColumnRule((L + "eh_proj.weight",), (("hidden", "hidden_x2"),))),
    _m("final_layernorm.weight", R((L + "shared_head.norm.weight",), (_H,))),
)
# The last stage keeps a synchronized copy of the word embeddings when it runs MTP layers.
_PRE = (
    _m(
        "embedding.word_embeddings.weight",
        VocabRule(("model.embed_tokens.weight",), first_stage_only=True),
    ),
)
_POST = (
    *_norm("decoder.final_layernorm", None, "model.norm"),
    _m("output_layer.weight", VocabRule(("lm_head.weight",)), "untied"),
    _m(
        "output_layer.weight",
        DroppedRule(reason="tied embeddings: the HF model reads lm_head from embed_tokens"),
        "tied",
    ),
)


# --- the table -------------------------------------------------------------------------------

_MLP = (L + "mlp", _LLAMA_MLP)
_QWEN2_MOE_MLP = (
    _dense_mlp(*_MLP)
    + _moe(*_MLP)
    + _shared_experts(L + "mlp.shared_expert", L + "mlp.shared_expert_gate.weight")
)
_QWEN3_5 = _hybrid_attention(qwen3_5=True)
_QWEN3_5_MTP = (  # Qwen3.5 checkpoint names (vLLM's Qwen3_5MTP, SGLang's Qwen3_5ForCausalLMMTP)
    _m("enorm.weight", R(("mtp.pre_fc_norm_embedding.weight",), (_H,))),
    _m("hnorm.weight", R(("mtp.pre_fc_norm_hidden.weight",), (_H,))),
    _m("eh_proj.weight", ColumnRule(("mtp.fc.weight",), (("hidden", "hidden_x2"),))),
    _m("final_layernorm.weight", R(("mtp.norm.weight",), (_H,))),
)

_DENSE = _attention() + _dense_mlp(L + "mlp", _LLAMA_MLP)
_QWEN_MOE = _attention() + _dense_mlp(L + "mlp", _LLAMA_MLP) + _moe(L + "mlp", _LLAMA_MLP)

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(("llama", "mistral"), llama_dims, _PRE, _DENSE, _POST),
    Architecture(("qwen2",), qwen2_dims, _PRE, _DENSE, _POST),
    Architecture(("qwen3",), qwen3_dims, _PRE, _DENSE, _POST),
    Architecture(("qwen3_moe",), qwen3_moe_dims, _PRE, _QWEN_MOE, _POST),
    Architecture(
        ("qwen2_moe",),
        qwen2_moe_dims,
        _PRE,
        _QWEN_MOE + _shared_experts(L + "mlp.shared_expert", L + "mlp.shared_expert_gate.weight"),
        _POST,
    ),
    Architecture(
        ("mixtral",),
        mixtral_dims,
        _PRE,
        _attention() + _moe(L + "block_sparse_moe", ("w1", "w3", "w2")),
        _POST,
    ),
    Architecture(
        ("glm4_moe",),
        glm4_moe_dims,
        _PRE,
        _QWEN_MOE + _shared_experts(L + "mlp.shared_experts", None),
        _POST,
        _MTP,
    ),
    Architecture(  # Kimi-K2 checkpoints are DeepSeek-V3 under their own model_type
        ("deepseek_v3", "kimi_k2"),
        deepseek_v3_dims,
        _PRE,
        _mla_attention()
        + _dense_mlp(L + "mlp", _LLAMA_MLP)
        + _moe(L + "mlp", _LLAMA_MLP)
        + _shared_experts(L + "mlp.shared_experts", None),
        _POST,
        _MTP,
    ),
    Architecture(
        ("qwen3_next",),
        qwen3_next_dims,
        _PRE,
        _hybrid_attention(qwen3_5=False) + _QWEN2_MOE_MLP,
        _POST,
    ),
    Architecture(
        ("qwen3_5_text",), qwen3_5_dims, _PRE, _QWEN3_5 + _dense_mlp(*_MLP), _POST, _QWEN3_5_MTP
    ),
    Architecture(
        ("qwen3_5_moe_text",), qwen3_5_dims, _PRE, _QWEN3_5 + _QWEN2_MOE_MLP, _POST, _QWEN3_5_MTP
    ),
    Architecture(
        ("starcoder2",),
        starcoder2_dims,
        _PRE,
        _attention()
        + (
            _m("mlp.linear_fc1.weight", ColumnRule((L + "mlp.c_fc.weight",), (("ffn", "hidden"),))),
            _m("mlp.linear_fc1.bias", ColumnRule((L + "mlp.c_fc.bias",), (("ffn",),)), "mlp_bias"),
            _m("mlp.linear_fc2.weight", RowRule((L + "mlp.c_proj.weight",), (("hidden", "ffn"),))),
            _m("mlp.linear_fc2.bias", R((L + "mlp.c_proj.bias",), (_H,)), "mlp_bias"),
        ),
        _POST,
    ),
)
