"""Qwen3.5 in SGLang (``qwen3_5_text`` dense, ``qwen3_5_moe_text`` MoE; gated delta net and
gated attention layers), and Qwen3-Next: one version through ``SglangWeightTarget``, with the
speculative worker's MTP model (``Qwen3_5ForCausalLMMTP``, ``Qwen3NextForCausalLMMTP``) as the
draft, loads the target and the draft together; each equals, bit for bit (every parameter and
buffer), a copy of the same SGLang class loaded by SGLang's own loader from the same tensors.

SGLang's classes read ``config.layers_block_type``, which only SGLang's own config classes
(``Qwen3_5TextConfig``, ``Qwen3_5MoeTextConfig``, ``Qwen3NextConfig``) derive (from
``full_attention_interval``): the config comes from SGLang's ``get_config`` of the saved
checkpoint, as SGLang's server loads it. The REAL SGLang classes, built on CPU
(tests/support/sglang.py); nothing runs forward, the comparison is of the weights.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.support.sglang import check_target_and_draft, install_cpu_shims

install_cpu_shims()  # before transformers or SGLang import torchvision

from tests.support import qwen3_5 as q  # noqa: E402
from tests.sweeps.archs import live_tensors  # noqa: E402

pytestmark = pytest.mark.sglang

SENTINEL = -7.0
"""Every parameter of every copy starts here: one the checkpoint leaves alone stays equal."""
DRAFTS = {
    "qwen3_5_text": ("qwen3_5_mtp", "Qwen3_5ForCausalLMMTP"),
    "qwen3_5_moe_text": ("qwen3_5_mtp", "Qwen3_5ForCausalLMMTP"),
    "qwen3_next": ("qwen3_next_mtp", "Qwen3NextForCausalLMMTP"),
}
"""The SGLang draft class of each model type's MTP layer (what SGLang's ``ModelConfig`` picks
for a draft model)."""


def sglang_config(path: Path):
    from sglang.srt.utils.hf_transformers_utils import get_config

    return get_config(str(path), trust_remote_code=False)


def _build(config, draft: bool) -> torch.nn.Module:
    import importlib

    from sglang.srt.models.registry import ModelRegistry

    if draft:
        module, name = DRAFTS[config.model_type]
        cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), name)
        # What SGLang's ModelConfig does for a draft model (is_draft_model)
        config = copy.deepcopy(config)
        config.architectures = [name]
        config.num_nextn_predict_layers = 1
    else:
        cls, _ = ModelRegistry.resolve_model_cls(config.architectures)
    with torch.device("cpu"):
        model = cls(config=config, quant_config=None)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.fill_(SENTINEL)
    return model


@pytest.mark.parametrize("model_type", q.MODEL_TYPES)
def test_a_version_loads_the_target_and_its_mtp_draft_like_sglang(model_type, tmp_path):
    from tests.support.sglang import init_sglang

    init_sglang()
    tensors = q.mtp_checkpoint(model_type)
    config = sglang_config(q.save(tmp_path, tensors, model_type))
    assert type(config).__module__.startswith("sglang.srt.configs.")
    assert config.layers_block_type == ["linear_attention", "attention"]
    main, draft = check_target_and_draft(
        lambda is_draft: _build(config, draft=is_draft),
        tensors,
        (f"{q.MTP_LAYER}no_such_proj.weight", "mtp.norm.weight"),
        "no_such_proj",
    )
    assert type(main).__name__ == config.architectures[0]
    for model in (main, draft):  # every tensor of both models was written
        assert not any((t == SENTINEL).all() for t in live_tensors(model).values())
    assert any(n.startswith("model.layers.0.linear_attn.") for n in live_tensors(main))
