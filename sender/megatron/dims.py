"""The sizes and switches of the target HF model that the Megatron -> HF rules need."""

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
"""Names a :class:`~weightsync.sender.megatron.names.ParamMapping` may use as its ``when``."""


@dataclass(frozen=True)
class ModelDims:
    """Read once from the HF config by the architecture's reader (see ``names.py``)."""

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
