"""Qwen3.5 (and Qwen3-Next) checkpoints with their MTP layer, as Qwen's checkpoints name it,
for the engines' classes and MTP draft classes. Imports torch and transformers only (both
venvs)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.sweeps.archs import _HYBRID, ARCHS, Arch, tiny_config

MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
MTP_LAYER = "mtp.layers.0."
MTP_OWN = frozenset(
    f"mtp.{n}.weight" for n in ("fc", "norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")
)
"""The checkpoints' MTP tensors outside its decoder layer (megatron's ``eh_proj``, its final
norm, ``enorm`` and ``hnorm``)."""


def config(model_type: str):
    """The sweep's tiny config of ``model_type`` (a gated delta net layer, then a full-attention
    one) with one MTP layer."""
    arch = next(a for a in ARCHS if a.model_type == model_type)
    cfg = tiny_config(Arch(model_type, {**_HYBRID, **arch.overrides}))
    if model_type == "qwen3_next":
        cfg.num_nextn_predict_layers = 1
    else:
        cfg.mtp_num_hidden_layers = 1
    return cfg


def mtp_checkpoint(model_type: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors: transformers' model with one more (full-attention) decoder
    layer, whose last layer is the MTP block, renamed ``mtp.layers.0.*``, plus ``mtp.fc``,
    ``mtp.norm`` and the two pre-fc norms (transformers' Qwen3.5 model drops MTP layers)."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    cfg = config(model_type)
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    cfg.layer_types = [*cfg.layer_types, "full_attention"]
    cfg.num_hidden_layers = layers + 1
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms start at 0 or 1 and biases at 0: make every tensor distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    state = revert_weight_conversion(model, dict(model.state_dict()))  # per-expert names
    last = f"model.layers.{layers}."
    tensors = {
        k.replace(last, MTP_LAYER) if k.startswith(last) else k: v.detach().clone()
        for k, v in state.items()
    }
    for name in sorted(MTP_OWN):  # the norms are 1-D; fc projects cat(embedding, hidden)
        shape = (hidden, 2 * hidden) if name == "mtp.fc.weight" else (hidden,)
        tensors[name] = torch.randn(shape) * 0.05
    return tensors


def save(path: Path, tensors: dict[str, torch.Tensor], model_type: str) -> Path:
    """``tensors`` and the config as Qwen's checkpoints write it: with
    ``full_attention_interval``, from which SGLang's config class derives the layer types
    (transformers reads it only without ``layer_types``, and does not write it)."""
    from safetensors.torch import save_file

    cfg = config(model_type)
    interval = cfg.layer_types.index("full_attention") + 1
    follows = [(i + 1) % interval == 0 for i in range(cfg.num_hidden_layers)]
    assert follows == [t == "full_attention" for t in cfg.layer_types], cfg.layer_types
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    written = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**written, "full_attention_interval": interval}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path
