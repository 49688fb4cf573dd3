"""The sizes and switches of the target HF model that the Megatron -> HF rules need, and the
readers that take them from a transformers config (one per architecture)."""

from __future__ import annotations

from dataclasses import dataclass

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
)
"""Names a :class:`~weightsync.sender.megatron.name_templates.ParamMapping` may use as its
``when``."""


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
        }
        return sizes[symbol]

    def shape(self, symbols: tuple[int | str, ...]) -> tuple[int, ...]:
        return tuple(self.size(s) for s in symbols)

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
