"""Shared helpers for the vLLM receiver tests: tiny local models, reference generation, and
driving a ``WeightTarget`` bucket by bucket the way the receiver core does."""

from __future__ import annotations

import os

# The in-process engine starts in seconds and lets tests reach the worker object directly.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from weightsync.buckets import TensorSpec  # noqa: E402
from weightsync.manifest import LoraAdapterSpec, VersionManifest  # noqa: E402

PROMPTS: tuple[tuple[int, ...], ...] = ((1, 2, 3, 4), (17, 99, 250, 3, 8), (400, 7))
MAX_NEW_TOKENS = 8
_COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def hf_config(kind: str):
    """A tiny config; hidden 128 / 4 heads keeps head_dim >= 32 as vLLM-CPU needs."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    if kind == "qwen2":
        return Qwen2Config(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True, **_COMMON)
    if kind == "llama":
        return LlamaConfig(architectures=["LlamaForCausalLM"], tie_word_embeddings=False, **_COMMON)
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(
            architectures=["Qwen3MoeForCausalLM"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            head_dim=32,
            tie_word_embeddings=False,
            **_COMMON,
        )
    raise ValueError(kind)


def checkpoint_template(kind: str) -> dict[str, torch.Tensor]:
    """The tiny model's tensors under checkpoint names (per-expert MoE names included)."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    model = AutoModelForCausalLM.from_config(hf_config(kind), dtype=torch.float32)
    state = revert_weight_conversion(model, dict(model.state_dict()))
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {k: v.detach().clone() for k, v in state.items()}


def save_checkpoint(kind: str, path: Path, weights: dict[str, torch.Tensor]) -> Path:
    """Write a loadable checkpoint (config + safetensors) of ``weights`` to ``path``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    hf_config(kind).save_pretrained(path)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return path


def hf_reference(kind: str, path: Path, weights: dict[str, torch.Tensor]) -> list[list[int]]:
    """transformers' greedy generation with ``weights``."""
    from transformers import AutoModelForCausalLM

    save_checkpoint(kind, path, weights)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return hf_greedy(model.eval())


def random_weights(template: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """New random weights, large enough that greedy generation is not one repeated token."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in template.items():
        if t.dim() == 1:
            out[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
        else:
            out[name] = torch.randn(t.shape, generator=gen) * (1.5 / t.shape[-1] ** 0.5)
    return out


def hf_greedy(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]] = PROMPTS
) -> list[list[int]]:
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            out = model.generate(
                ids,
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                attention_mask=torch.ones_like(ids),
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def vllm_greedy(
    llm, prompts: Sequence[Sequence[int]] = PROMPTS, lora_request=None
) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # Cached prefixes hold KV computed with the previous weights; whoever updates weights
    # must drop them (the HTTP flow does it through /pause with clear_cache).
    llm.reset_prefix_cache()
    outs = llm.generate(
        [{"prompt_token_ids": list(p)} for p in prompts],
        params,
        lora_request=lora_request,
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def make_llm(path: Path, **kwargs):
    from vllm import LLM

    return LLM(
        model=str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=4,
        seed=0,
        gpu_memory_utilization=0.1,
        kv_cache_memory_bytes=32 << 20,
        **kwargs,
    )


def worker_of(llm):
    """The in-process worker (needs VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.collective_rpc(_identity)[0]


def _identity(worker):
    return worker


def manifest_of(
    version: int, tensors: dict[str, torch.Tensor], lora: LoraAdapterSpec | None = None
) -> VersionManifest:
    return VersionManifest(version, tuple(TensorSpec.of(n, t) for n, t in tensors.items()), lora)


def drive(
    target, manifest: VersionManifest, tensors: dict[str, torch.Tensor], per_bucket: int
) -> None:
    """validate/begin/load/commit with ``per_bucket`` tensors per bucket, each handed over as
    views of ONE reused buffer that is scribbled over after every load (as transports do)."""
    target.validate(manifest)
    target.begin(manifest)
    names = list(tensors)
    total = max(t.numel() for t in tensors.values()) * per_bucket
    buffer = torch.empty(total, dtype=torch.float32)
    try:
        for start in range(0, len(names), per_bucket):
            views, offset = [], 0
            for name in names[start : start + per_bucket]:
                t = tensors[name]
                view = buffer[offset : offset + t.numel()].view(t.shape)
                view.copy_(t)
                views.append((name, view))
                offset += t.numel()
            target.load(views)
            buffer.fill_(float("nan"))
    except Exception as e:
        target.abort(manifest, e)
        raise
    target.commit(manifest)
