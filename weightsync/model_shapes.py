"""HF tensor names, shapes and bytes of a model, from its config alone (no weights built).

Pure: a config is a mapping (a ``config.json`` read by the caller, or a :data:`PRESETS` entry).
Architectures: dense GQA decoders (``llama``, ``mistral``, ``qwen2``, ``qwen3``), MoE ones
(``qwen3_moe``, ``mixtral``) and MLA + MoE ones (``deepseek_v2``, ``deepseek_v3``, ``kimi_k2``).
Multi-token-prediction layers are left out (engines load them only for speculative decoding).

Each :class:`ModelTensor` says how tensor parallelism splits it (``split``): ``column`` along
dim 0 (q/k/v, gate/up), ``vocab`` along dim 0 after padding the vocabulary to a multiple of
:data:`VOCAB_PADDING` (embedding, lm_head), ``row`` along dim 1 (o, down), ``replicated`` whole
on every rank (norms, routers, MLA's down projections). FP8 (``fp8=True``): the decoder layers'
linear weights are 1 byte per parameter, each with a float32 ``weight_scale_inv`` of one value
per 128 x 128 block (the DeepSeek-V3 checkpoint format); embeddings, norms and routers keep
their dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from weightsync.errors import ConfigError

Split = Literal["replicated", "column", "row", "vocab"]
FP8_BLOCK = 128
VOCAB_PADDING = 64
"""vLLM's and SGLang's ``DEFAULT_VOCAB_PADDING_SIZE``: a vocab-parallel embedding pads its
rows to a multiple of it, then splits the padded rows evenly."""
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class ModelTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    split: Split
    layer: int | None = None
    """Decoder layer; None: before (embedding) or after (final norm, lm_head) the layers."""
    expert: int | None = None
    heads: int = 0
    """A column split that keeps whole heads: the number of heads (0: any rows); ranks beyond
    it share heads (GQA's k/v when TP exceeds the KV heads)."""
    scale_of: str | None = None
    """For an FP8 block scale: the weight it scales (its boxes follow the weight's, in blocks)."""

    @property
    def nbytes(self) -> int:
        n = _ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


PRESETS: dict[str, dict[str, Any]] = {
    # moonshotai/Kimi-K2-Instruct config.json (the fields read here).
    "kimi-k2": {
        "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "topk_method": "noaux_tc",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    # deepseek-ai/DeepSeek-V3 config.json.
    "deepseek-v3": {
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "topk_method": "noaux_tc",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    # Qwen/Qwen3-235B-A22B config.json.
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}  # fmt: skip

_DENSE = ("llama", "mistral", "qwen2", "qwen3")
_MOE = ("qwen3_moe", "mixtral")
_MLA = ("deepseek_v2", "deepseek_v3", "kimi_k2")
MODEL_TYPES = _DENSE + _MOE + _MLA


def _field(cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = cfg.get(key, default)
    if value is None:
        raise ConfigError(f"model config: {key} is missing (model_type {cfg.get('model_type')!r})")
    return value


def _positive(cfg: Mapping[str, Any], key: str, default: Any = None) -> int:
    value = _field(cfg, key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"model config: {key}={value!r} must be a positive integer")
    return value


class _Builder:
    def __init__(self, dtype: str, fp8: bool) -> None:
        self.dtype, self.fp8 = dtype, fp8
        self.out: list[ModelTensor] = []

    def plain(self, name: str, shape: tuple[int, ...], split: Split = "replicated", **kw) -> None:
        self.out.append(ModelTensor(name, shape, kw.pop("dtype", self.dtype), split, **kw))

    def linear(self, name: str, rows: int, cols: int, split: Split, **kw: Any) -> None:
        """A decoder linear ``name`` (without ``.weight``): FP8 with its block scale if fp8."""
        if not self.fp8:
            self.plain(f"{name}.weight", (rows, cols), split, **kw)
            return
        self.plain(f"{name}.weight", (rows, cols), split, dtype="float8_e4m3fn", **kw)
        blocks = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
        kw.pop("heads", None)
        self.plain(
            f"{name}.weight_scale_inv", blocks, split, dtype="float32",
            scale_of=f"{name}.weight", **kw,
        )  # fmt: skip


def model_tensors(
    config: Mapping[str, Any], *, dtype: str | None = None, fp8: bool = False
) -> tuple[ModelTensor, ...]:
    """Every HF tensor an engine loads for ``config``, in checkpoint order.

    Raises:
        ConfigError: an unknown ``model_type`` or dtype, a missing or non-positive size field.
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"model config: model_type {model_type!r} is not supported; supported: "
            f"{', '.join(MODEL_TYPES)}"
        )
    dtype = dtype or str(config.get("torch_dtype") or "bfloat16")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"model config: dtype {dtype!r}; expected bfloat16, float16 or float32")
    hidden = _positive(config, "hidden_size")
    vocab = _positive(config, "vocab_size")
    layers = _positive(config, "num_hidden_layers")
    b = _Builder(dtype, fp8)
    b.plain("model.embed_tokens.weight", (vocab, hidden), "vocab")
    for i in range(layers):
        p = f"model.layers.{i}"
        b.plain(f"{p}.input_layernorm.weight", (hidden,), layer=i)
        if model_type in _MLA:
            _mla(b, config, p, i, hidden)
        else:
            _gqa(b, config, p, i, hidden, qk_norm=model_type.startswith("qwen3"))
        b.plain(f"{p}.post_attention_layernorm.weight", (hidden,), layer=i)
        _mlp(b, config, str(model_type), p, i, hidden)
    b.plain("model.norm.weight", (hidden,))
    if not config.get("tie_word_embeddings", False):
        b.plain("lm_head.weight", (vocab, hidden), "vocab")
    return tuple(b.out)


def _gqa(b: _Builder, cfg: Mapping[str, Any], p: str, i: int, hidden: int, qk_norm: bool) -> None:
    heads = _positive(cfg, "num_attention_heads")
    kv = _positive(cfg, "num_key_value_heads", heads)
    head_dim = _positive(cfg, "head_dim", hidden // heads)
    bias = bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2"))
    a = f"{p}.self_attn"
    for name, n in (("q_proj", heads), ("k_proj", kv), ("v_proj", kv)):
        b.linear(f"{a}.{name}", n * head_dim, hidden, "column", layer=i, heads=n)
        if bias:
            b.plain(f"{a}.{name}.bias", (n * head_dim,), "column", layer=i, heads=n)
    b.linear(f"{a}.o_proj", hidden, heads * head_dim, "row", layer=i)
    if qk_norm:
        b.plain(f"{a}.q_norm.weight", (head_dim,), layer=i)
        b.plain(f"{a}.k_norm.weight", (head_dim,), layer=i)


def _mla(b: _Builder, cfg: Mapping[str, Any], p: str, i: int, hidden: int) -> None:
    heads = _positive(cfg, "num_attention_heads")
    nope, rope = _positive(cfg, "qk_nope_head_dim"), _positive(cfg, "qk_rope_head_dim")
    v_dim, kv_rank = _positive(cfg, "v_head_dim"), _positive(cfg, "kv_lora_rank")
    a = f"{p}.self_attn"
    if cfg.get("q_lora_rank"):
        q_rank = _positive(cfg, "q_lora_rank")
        b.linear(f"{a}.q_a_proj", q_rank, hidden, "replicated", layer=i)
        b.plain(f"{a}.q_a_layernorm.weight", (q_rank,), layer=i)
        b.linear(f"{a}.q_b_proj", heads * (nope + rope), q_rank, "column", layer=i, heads=heads)
    else:
        b.linear(f"{a}.q_proj", heads * (nope + rope), hidden, "column", layer=i, heads=heads)
    b.linear(f"{a}.kv_a_proj_with_mqa", kv_rank + rope, hidden, "replicated", layer=i)
    b.plain(f"{a}.kv_a_layernorm.weight", (kv_rank,), layer=i)
    b.linear(f"{a}.kv_b_proj", heads * (nope + v_dim), kv_rank, "column", layer=i, heads=heads)
    b.linear(f"{a}.o_proj", hidden, heads * v_dim, "row", layer=i)


def _is_moe(cfg: Mapping[str, Any], model_type: str, i: int) -> bool:
    if model_type in _MLA:
        first = int(cfg.get("first_k_dense_replace") or 0)
        return i >= first and i % int(cfg.get("moe_layer_freq") or 1) == 0
    if model_type == "qwen3_moe":
        step = int(cfg.get("decoder_sparse_step") or 1)
        return i not in set(cfg.get("mlp_only_layers") or ()) and (i + 1) % step == 0
    return model_type == "mixtral"


def _mlp(b: _Builder, cfg: Mapping[str, Any], model_type: str, p: str, i: int, hidden: int) -> None:
    moe = _is_moe(cfg, model_type, i)
    if not moe:
        ffn = _positive(cfg, "intermediate_size")
        _gated(b, f"{p}.mlp", ("gate_proj", "up_proj", "down_proj"), ffn, hidden, i, None)
        return
    if model_type == "mixtral":
        experts, ffn = _positive(cfg, "num_local_experts"), _positive(cfg, "intermediate_size")
        b.plain(f"{p}.block_sparse_moe.gate.weight", (experts, hidden), layer=i)
        for e in range(experts):
            _gated(b, f"{p}.block_sparse_moe.experts.{e}", ("w1", "w3", "w2"), ffn, hidden, i, e)
        return
    ffn = _positive(cfg, "moe_intermediate_size")
    key = "n_routed_experts" if model_type in _MLA else "num_experts"
    if key not in cfg and "num_local_experts" in cfg:
        key = "num_local_experts"  # how transformers 5 saves Qwen3-MoE's num_experts
    experts = _positive(cfg, key)
    b.plain(f"{p}.mlp.gate.weight", (experts, hidden), layer=i)
    # DeepSeek-V3 / Kimi-K2 route with a learned bias (noaux_tc); DeepSeek-V2 without.
    default_topk = "greedy" if model_type == "deepseek_v2" else "noaux_tc"
    if model_type in _MLA and cfg.get("topk_method", default_topk) == "noaux_tc":
        b.plain(f"{p}.mlp.gate.e_score_correction_bias", (experts,), layer=i, dtype="float32")
    names = ("gate_proj", "up_proj", "down_proj")
    for e in range(experts):
        _gated(b, f"{p}.mlp.experts.{e}", names, ffn, hidden, i, e)
    shared = int(cfg.get("n_shared_experts") or 0) if model_type in _MLA else 0
    if shared:
        _gated(b, f"{p}.mlp.shared_experts", names, ffn * shared, hidden, i, None)


def _gated(
    b: _Builder, p: str, names: tuple[str, str, str], ffn: int, hidden: int, i: int, e: int | None
) -> None:
    gate, up, down = names
    b.linear(f"{p}.{gate}", ffn, hidden, "column", layer=i, expert=e)
    b.linear(f"{p}.{up}", ffn, hidden, "column", layer=i, expert=e)
    b.linear(f"{p}.{down}", hidden, ffn, "row", layer=i, expert=e)


def total_params(tensors: tuple[ModelTensor, ...]) -> int:
    """Parameters of the model (FP8 scales not counted)."""
    total = 0
    for t in tensors:
        if t.scale_of is None:
            n = 1
            for d in t.shape:
                n *= d
            total += n
    return total
