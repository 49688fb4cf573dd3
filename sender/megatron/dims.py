"""The sizes and switches of the target HF model that the Megatron -> HF rules need, and the
readers that take them from a transformers config (one per architecture)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from weightsync.errors import PlanError

CONDITIONS = (
    "tied",
    "untied",
    "qkv_bias",
    "o_bias",
    "mlp_bias",
    "norm_bias",
    "qk_norm",
    "dense_layer",
    "moe_layer",
    "shared_expert",
    "shared_expert_gate",
    "expert_bias",
    "q_lora",
    "no_q_lora",
    "full_attention",
    "linear_attention",
)
"""Names a :class:`~weightsync.sender.megatron.name_templates.ParamMapping` may use as its
``when``."""


_DECODER_LAYER = "model.layers.{layer}."


@dataclass(frozen=True)
class ModelDims:
    """Read once from the HF config by the architecture's reader (below)."""

    model_type: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    """Dense MLP intermediate size (0 when the model has no dense MLP layer)."""
    vocab: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    shared_expert_gate: bool = False
    expert_bias: bool = False
    moe_layers: frozenset[int] = frozenset()
    num_mtp_layers: int = 0
    """Multi-token-prediction layers, numbered after the decoder layers (GLM-4.5 / DeepSeek-V3
    checkpoints name MTP layer i ``model.layers.{num_layers + i}``)."""
    mtp_prefix: str = ""
    """Where checkpoints put MTP layer i's decoder tensors instead, ``{prefix}{i}.`` (Qwen3.5:
    ``mtp.layers.``); empty: after the decoder layers."""
    q_lora_rank: int = 0
    """Multi-latent attention (DeepSeek-V3): the query's low rank; 0 when queries are projected
    directly (``q_proj``, HF ``q_lora_rank=None``)."""
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    linear_layers: frozenset[int] = frozenset()
    """Gated delta net layers (Qwen3-Next / Qwen3.5 ``layer_types`` "linear_attention")."""
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv_kernel: int = 0

    def __post_init__(self) -> None:
        positive = ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "vocab")
        for name in positive:
            if getattr(self, name) < 1:
                raise PlanError(f"HF config ({self.model_type}): {name}={getattr(self, name)} < 1")
        if self.num_heads % self.num_kv_heads:
            raise PlanError(
                f"HF config ({self.model_type}): num_attention_heads={self.num_heads} is not a "
                f"multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.moe_layers and (self.num_experts < 1 or self.moe_ffn < 1):
            raise PlanError(
                f"HF config ({self.model_type}): MoE layers need experts and their size"
            )
        bad = [i for i in self.moe_layers if not 0 <= i < self.num_layers + self.num_mtp_layers]
        if bad:
            raise PlanError(f"HF config ({self.model_type}): MoE layer {bad[0]} out of range")
        if self.linear_layers and (
            min(self.linear_k_heads, self.linear_k_dim, self.linear_v_dim) < 1
            or self.linear_v_heads % self.linear_k_heads
        ):
            raise PlanError(
                f"HF config ({self.model_type}): linear_num_value_heads={self.linear_v_heads} "
                f"must be a positive multiple of linear_num_key_heads={self.linear_k_heads}, "
                "with positive head dims"
            )

    def size(self, symbol: int | str) -> int:
        """A dimension by symbol (``"hidden"``, ``"q_rows"``, ...) or a literal int."""
        if isinstance(symbol, int):
            return symbol
        sizes = {
            "hidden": self.hidden,
            "hidden_x2": 2 * self.hidden,
            "head_dim": self.head_dim,
            "q_rows": self.num_heads * self.head_dim,
            "kv_rows": self.num_kv_heads * self.head_dim,
            "ffn": self.ffn,
            "moe_ffn": self.moe_ffn,
            "shared_ffn": self.shared_ffn,
            "experts": self.num_experts,
            "vocab": self.vocab,
            "q_lora": self.q_lora_rank,
            "kv_lora": self.kv_lora_rank,
            "mla_q_rows": self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim),
            "kv_a_rows": self.kv_lora_rank + self.qk_rope_head_dim,
            "kv_b_rows": self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
            "v_rows": self.num_heads * self.v_head_dim,
            "q_gate_rows": 2 * self.num_heads * self.head_dim,
            **self._linear_sizes(),
        }
        return sizes[symbol]

    def _linear_sizes(self) -> dict[str, int]:
        """Gated delta net sizes; ``per_k``: what one key head's group holds."""
        per_k = self.linear_v_heads // self.linear_k_heads if self.linear_k_heads else 0
        k_rows, v_rows = (
            self.linear_k_heads * self.linear_k_dim,
            self.linear_v_heads * self.linear_v_dim,
        )
        return {
            "lin_k_dim": self.linear_k_dim,
            "lin_v_dim": self.linear_v_dim,
            "lin_v_per_k": per_k * self.linear_v_dim,
            "lin_heads_per_k": per_k,
            "lin_v_heads": self.linear_v_heads,
            "lin_k_rows": k_rows,
            "lin_v_rows": v_rows,
            "lin_qkvz": 2 * k_rows + 2 * v_rows,
            "lin_ba": 2 * self.linear_v_heads,
            "lin_conv": 2 * k_rows + v_rows,
            "lin_conv_kernel": self.linear_conv_kernel,
        }

    def shape(self, symbols: tuple[int | str, ...]) -> tuple[int, ...]:
        return tuple(self.size(s) for s in symbols)

    def hf_name(self, template: str, layer: int | None, expert: int | None) -> str:
        """``template`` for a global ``layer`` (MTP layers under :attr:`mtp_prefix`)."""
        if self.mtp_prefix and layer is not None and layer >= self.num_layers:
            template = template.replace(_DECODER_LAYER, self.mtp_prefix + "{layer}.")
            layer -= self.num_layers
        return template.format(layer=layer, expert=expert)

    def holds(self, condition: str | None, layer: int | None = None) -> bool:
        """Whether the HF model has the tensors a mapping guarded by ``condition`` produces."""
        if condition is None:
            return True
        moe = layer in self.moe_layers
        values = {
            "tied": self.tied,
            "untied": not self.tied,
            "qkv_bias": self.qkv_bias,
            "o_bias": self.o_bias,
            "mlp_bias": self.mlp_bias,
            "norm_bias": self.norm_bias,
            "qk_norm": self.qk_norm,
            "dense_layer": not moe,
            "moe_layer": moe,
            "shared_expert": moe and self.shared_ffn > 0,
            "shared_expert_gate": moe and self.shared_ffn > 0 and self.shared_expert_gate,
            "expert_bias": moe and self.expert_bias,
            "q_lora": self.q_lora_rank > 0,
            "no_q_lora": self.q_lora_rank == 0,
            "full_attention": layer not in self.linear_layers,
            "linear_attention": layer in self.linear_layers,
        }
        return values[condition]


# --- readers: a transformers config -> ModelDims ------------------------------------------


def _dims(cfg: object, **extra: object) -> ModelDims:
    heads = cfg.num_attention_heads
    hidden = cfg.hidden_size
    return ModelDims(
        model_type=cfg.model_type,
        num_layers=cfg.num_hidden_layers,
        hidden=hidden,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or hidden // heads,
        ffn=getattr(cfg, "intermediate_size", 0) or 0,
        vocab=cfg.vocab_size,
        tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        **extra,
    )


def _sparse_layers(cfg: object) -> frozenset[int]:
    """Qwen MoE: layer i is sparse unless in ``mlp_only_layers``, every ``decoder_sparse_step``."""
    skip = set(getattr(cfg, "mlp_only_layers", None) or ())
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return frozenset(
        i for i in range(cfg.num_hidden_layers) if i not in skip and (i + 1) % step == 0
    )


def llama_dims(cfg: object) -> ModelDims:
    bias = bool(getattr(cfg, "attention_bias", False))
    return _dims(cfg, qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)))


def qwen2_dims(cfg: object) -> ModelDims:
    return _dims(cfg, qkv_bias=True)


def qwen3_dims(cfg: object, **extra: object) -> ModelDims:
    bias = bool(getattr(cfg, "attention_bias", False))
    return _dims(cfg, qkv_bias=bias, o_bias=bias, qk_norm=True, **extra)


def qwen3_moe_dims(cfg: object) -> ModelDims:
    return qwen3_dims(
        cfg,
        num_experts=cfg.num_experts,
        moe_ffn=cfg.moe_intermediate_size,
        moe_layers=_sparse_layers(cfg),
    )


def qwen2_moe_dims(cfg: object) -> ModelDims:
    return _dims(
        cfg,
        qkv_bias=True,
        num_experts=cfg.num_experts,
        moe_ffn=cfg.moe_intermediate_size,
        shared_ffn=cfg.shared_expert_intermediate_size,
        shared_expert_gate=True,
        moe_layers=_sparse_layers(cfg),
    )


def mixtral_dims(cfg: object) -> ModelDims:
    return _dims(
        cfg,
        num_experts=cfg.num_local_experts,
        moe_ffn=cfg.intermediate_size,
        moe_layers=frozenset(range(cfg.num_hidden_layers)),
    )


def starcoder2_dims(cfg: object) -> ModelDims:
    bias = bool(getattr(cfg, "use_bias", True))
    return _dims(cfg, qkv_bias=bias, o_bias=bias, mlp_bias=bias, norm_bias=True)


def glm4_moe_dims(cfg: object) -> ModelDims:
    dense = getattr(cfg, "first_k_dense_replace", 0) or 0
    mtp = getattr(cfg, "num_nextn_predict_layers", 0) or 0
    return _dims(
        cfg,
        qkv_bias=bool(getattr(cfg, "attention_bias", False)),
        qk_norm=bool(getattr(cfg, "use_qk_norm", False)),
        num_experts=cfg.n_routed_experts,
        moe_ffn=cfg.moe_intermediate_size,
        shared_ffn=cfg.moe_intermediate_size * (getattr(cfg, "n_shared_experts", 0) or 0),
        expert_bias=True,
        moe_layers=frozenset(range(dense, cfg.num_hidden_layers + mtp)),
        num_mtp_layers=mtp,
    )


def deepseek_v3_dims(cfg: object) -> ModelDims:
    """DeepSeek-V3 / Kimi-K2: MLA, the first ``first_k_dense_replace`` layers dense, MoE with
    shared experts and the routing bias after them (MTP layers included)."""
    if getattr(cfg, "attention_bias", False):
        raise PlanError(
            f"HF config ({cfg.model_type}): attention_bias=True gives q_a_proj / q_proj / "
            "kv_a_proj_with_mqa biases, which megatron-core's MLA does not have"
        )
    return replace(
        glm4_moe_dims(cfg),
        q_lora_rank=getattr(cfg, "q_lora_rank", None) or 0,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
    )


def qwen3_next_dims(cfg: object) -> ModelDims:
    """Qwen3-Next: gated delta net layers (``layer_types``) between gated full-attention
    layers, MoE with a gated shared expert (Qwen2-MoE's), dense layers in ``mlp_only_layers``."""
    return _hybrid(cfg, qwen2_moe_dims(cfg))


def qwen3_5_dims(cfg: object) -> ModelDims:
    """Qwen3.5 text models (``qwen3_5_text`` dense, ``qwen3_5_moe_text`` MoE in every layer):
    Qwen3-Next's layers with the GDN input projection kept in four tensors; the MTP layer
    (``mtp_num_hidden_layers``, a full-attention layer) under ``mtp.layers.0.``."""
    mtp = getattr(cfg, "mtp_num_hidden_layers", 0) or 0
    if mtp > 1:
        raise PlanError(
            f"HF config ({cfg.model_type}): mtp_num_hidden_layers={mtp}; Qwen3.5 checkpoints "
            "hold one mtp.fc / mtp.norm for all MTP layers, megatron-core one per layer: only 1 "
            "converts"
        )
    moe = bool(getattr(cfg, "num_experts", 0))
    base = qwen2_moe_dims(cfg) if moe else _dims(cfg)
    layers = range(cfg.num_hidden_layers + mtp)
    return replace(
        _hybrid(cfg, base),
        num_mtp_layers=mtp,
        mtp_prefix="mtp.layers.",
        moe_layers=frozenset(layers) if moe else frozenset(),
    )


def _hybrid(cfg: object, base: ModelDims) -> ModelDims:
    if getattr(cfg, "attention_bias", False):
        raise PlanError(
            f"HF config ({cfg.model_type}): attention_bias=True is not supported (megatron's "
            "gated attention is converted without q/k/v biases)"
        )
    types = list(cfg.layer_types)
    return replace(
        base,
        qkv_bias=False,
        qk_norm=True,
        linear_layers=frozenset(i for i, t in enumerate(types) if t == "linear_attention"),
        linear_k_heads=cfg.linear_num_key_heads,
        linear_v_heads=cfg.linear_num_value_heads,
        linear_k_dim=cfg.linear_key_head_dim,
        linear_v_dim=cfg.linear_value_head_dim,
        linear_conv_kernel=cfg.linear_conv_kernel_dim,
    )
