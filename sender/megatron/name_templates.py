"""Per-architecture name templates: which rule turns which Megatron parameter into which HF tensors.

Data only: this table puts together, per architecture, the mappings of :mod:`.name_blocks`
(:class:`~.name_mapping.Architecture`, :class:`~.name_mapping.ParamMapping`); each architecture's
config reader is in :mod:`.dims`, the lookup by Megatron name in :mod:`.name_table`. Megatron
names are templates relative to the chunk (``{layer}`` = the chunk-local layer index in the
name, ``{expert}`` = the local expert index); HF names use the global layer and global expert.
Each mapping lists every Megatron spelling of the same tensor:

- local spec (``get_gpt_layer_local_spec``): ``input_layernorm.weight``,
  ``pre_mlp_layernorm.weight``, ``mlp.experts.local_experts.{expert}.linear_fc1.weight``
  (``SequentialMLP``), ``mlp.experts.weight1`` / ``weight2`` (legacy ``GroupedMLP``);
- TE spec (``get_gpt_layer_with_transformer_engine_spec``): the layer norms are fused into the
  next linear (``self_attention.linear_qkv.layer_norm_weight``,
  ``mlp.linear_fc1.layer_norm_weight``: megatron's own ``sharded_state_dict_keys_map`` of the
  local spec says so) except before MoE, where ``pre_mlp_layernorm`` stays;
  ``TEGroupedMLP`` names experts ``mlp.experts.linear_fc1.weight{expert}``.

Every Megatron parameter must match exactly one mapping whose condition holds (unknown names
are errors); tensors deliberately not sent are :class:`~.rules.DroppedRule` rows, visible in
:mod:`.name_blocks`.
"""

from __future__ import annotations

from .dims import (
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
from .name_blocks import (
    LLAMA_MLP,
    MTP,
    POST,
    PRE,
    QWEN3_5_MTP,
    L,
    attention,
    dense_mlp,
    hybrid_attention,
    mla_attention,
    moe,
    plain_mlp,
    shared_experts,
)
from .name_mapping import Architecture

_MLP = (L + "mlp", LLAMA_MLP)
_QWEN2_MOE_MLP = (
    dense_mlp(*_MLP)
    + moe(*_MLP)
    + shared_experts(L + "mlp.shared_expert", L + "mlp.shared_expert_gate.weight")
)
_QWEN3_5 = hybrid_attention(qwen3_5=True)
_DENSE = attention() + dense_mlp(L + "mlp", LLAMA_MLP)
_QWEN_MOE = attention() + dense_mlp(L + "mlp", LLAMA_MLP) + moe(L + "mlp", LLAMA_MLP)

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(("llama", "mistral"), llama_dims, PRE, _DENSE, POST),
    Architecture(("qwen2",), qwen2_dims, PRE, _DENSE, POST),
    Architecture(("qwen3",), qwen3_dims, PRE, _DENSE, POST),
    Architecture(("qwen3_moe",), qwen3_moe_dims, PRE, _QWEN_MOE, POST),
    Architecture(
        ("qwen2_moe",),
        qwen2_moe_dims,
        PRE,
        _QWEN_MOE + shared_experts(L + "mlp.shared_expert", L + "mlp.shared_expert_gate.weight"),
        POST,
    ),
    Architecture(
        ("mixtral",),
        mixtral_dims,
        PRE,
        attention() + moe(L + "block_sparse_moe", ("w1", "w3", "w2")),
        POST,
    ),
    Architecture(
        ("glm4_moe",),
        glm4_moe_dims,
        PRE,
        _QWEN_MOE + shared_experts(L + "mlp.shared_experts", None),
        POST,
        MTP,
    ),
    Architecture(  # Kimi-K2 checkpoints are DeepSeek-V3 under their own model_type
        ("deepseek_v3", "kimi_k2"),
        deepseek_v3_dims,
        PRE,
        mla_attention()
        + dense_mlp(L + "mlp", LLAMA_MLP)
        + moe(L + "mlp", LLAMA_MLP)
        + shared_experts(L + "mlp.shared_experts", None),
        POST,
        MTP,
    ),
    Architecture(
        ("qwen3_next",),
        qwen3_next_dims,
        PRE,
        hybrid_attention(qwen3_5=False) + _QWEN2_MOE_MLP,
        POST,
    ),
    Architecture(
        ("qwen3_5_text",), qwen3_5_dims, PRE, _QWEN3_5 + dense_mlp(*_MLP), POST, QWEN3_5_MTP
    ),
    Architecture(
        ("qwen3_5_moe_text",), qwen3_5_dims, PRE, _QWEN3_5 + _QWEN2_MOE_MLP, POST, QWEN3_5_MTP
    ),
    Architecture(
        ("starcoder2",),
        starcoder2_dims,
        PRE,
        attention() + plain_mlp(L + "mlp"),
        POST,
    ),
)
