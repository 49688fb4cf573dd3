"""MTP draft models in SGLang: one version through ``SglangWeightTarget`` with the speculative
worker's MTP model (``Glm4MoeForCausalLMNextN``, ``DeepseekV3ForCausalLMNextN``) loads the
target model and the draft model together; each equals, bit for bit (every parameter and
buffer), a copy of the same SGLang class loaded by SGLang's own loader from the same tensors.
Without a draft model the MTP layer is ignored, with a warning.

The REAL SGLang classes, built on CPU (tests/support/sglang.py); SGLang's CPU kernels are not
installed, so nothing runs forward and no speculative engine can start here: the comparison is
of the weights.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import pytest
import torch

from tests.support.sglang import check_target_and_draft, install_cpu_shims, sglang_load

install_cpu_shims()  # before transformers or SGLang import torchvision

from tests.support import drive, manifest_of  # noqa: E402
from tests.support.models import checkpoint_tensors  # noqa: E402
from tests.sweeps.archs import ARCHS, BUCKET_BYTES, differing, live_tensors, tiny_config  # noqa: E402

pytestmark = pytest.mark.sglang

LAYERS = 2
MTP = f"model.layers.{LAYERS}."
SENTINEL = -7.0
DRAFTS = {
    "glm4_moe": ("glm4_moe_nextn", "Glm4MoeForCausalLMNextN"),
    "deepseek_v3": ("deepseek_nextn", "DeepseekV3ForCausalLMNextN"),
}
"""The SGLang draft class of each architecture's MTP layer."""


def _config(model_type: str):
    config = tiny_config(next(a for a in ARCHS if a.model_type == model_type))
    config.num_nextn_predict_layers = 1
    return config


def mtp_checkpoint(model_type: str, path: Path) -> dict[str, torch.Tensor]:
    """What transformers' ``save_pretrained`` writes for the model with one more decoder layer
    (the MTP block), plus the MTP layer's own tensors, named as the engines expect them."""
    from transformers import AutoModelForCausalLM

    config = _config(model_type)
    config.num_hidden_layers = LAYERS + 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    tensors = checkpoint_tensors(path)
    hidden, vocab = config.hidden_size, config.vocab_size
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{MTP}{name}.weight"] = 1 + torch.randn(hidden) * 0.05
    tensors[f"{MTP}eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * 0.05
    tensors[f"{MTP}shared_head.head.weight"] = torch.randn(vocab, hidden) * 0.05
    return tensors


def _build(model_type: str, draft: bool) -> torch.nn.Module:
    import importlib

    from tests.support.sglang import init_sglang

    init_sglang()
    from sglang.srt.models.registry import ModelRegistry

    config = _config(model_type)
    if draft:
        module, name = DRAFTS[model_type]
        cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), name)
    else:
        cls, _ = ModelRegistry.resolve_model_cls(config.architectures)
    kwargs = {"quant_config": None} if "quant_config" in inspect.signature(cls).parameters else {}
    with torch.device("cpu"):
        model = cls(config=config, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.fill_(SENTINEL)
    return model


@pytest.mark.parametrize("model_type", sorted(DRAFTS))
def test_a_version_loads_target_and_draft_like_sglang(model_type, tmp_path):
    tensors = mtp_checkpoint(model_type, tmp_path)
    _, draft = check_target_and_draft(
        lambda is_draft: _build(model_type, draft=is_draft),
        tensors,
        (f"{MTP}no_such_proj.weight", f"{MTP}enorm.weight"),
        r"NextN.*no_such_proj",
    )
    assert not any((t == SENTINEL).all() for t in live_tensors(draft).values())


def test_without_a_draft_model_the_mtp_layer_is_ignored(tmp_path, caplog):
    from weightsync.receiver.sglang.target import SglangWeightTarget

    tensors = mtp_checkpoint("glm4_moe", tmp_path)
    main = _build("glm4_moe", draft=False)
    with caplog.at_level(logging.WARNING, logger="weightsync.receiver.sglang.target"):
        drive(SglangWeightTarget(main, "cpu"), manifest_of(1, tensors), tensors, BUCKET_BYTES)
    warned = [r.getMessage() for r in caplog.records if "no draft model" in r.getMessage()]
    assert len(warned) == 1 and "version 1" in warned[0] and MTP in warned[0]
    want = sglang_load(_build("glm4_moe", draft=False), tensors)
    assert not differing(live_tensors(main).items(), live_tensors(want).items())


@pytest.mark.parametrize(
    ("model_type", "declared", "extra"),
    [
        # no MTP declared: a third layer of a 2-layer model is the wrong model, not MTP
        ("mixtral", None, f"{MTP}input_layernorm.weight"),
        # one MTP layer declared (model.layers.2): the layer after it is not one
        ("glm4_moe", 1, f"model.layers.{LAYERS + 1}.enorm.weight"),
    ],
)
def test_a_layer_the_model_does_not_have_is_refused_naming_it(
    model_type, declared, extra, tmp_path
):
    from tests.support.sglang import init_sglang
    from tests.sweeps.archs import save_checkpoint
    from weightsync.errors import NameResolutionError

    init_sglang()
    from sglang.srt.models.registry import ModelRegistry

    from weightsync.receiver.sglang.target import SglangWeightTarget

    arch = next(a for a in ARCHS if a.model_type == model_type)
    tensors = save_checkpoint(arch, tmp_path)
    config = tiny_config(arch)
    config.num_nextn_predict_layers = declared
    cls, _ = ModelRegistry.resolve_model_cls(config.architectures)
    kwargs = {"quant_config": None} if "quant_config" in inspect.signature(cls).parameters else {}
    with torch.device("cpu"):
        model = cls(config=config, **kwargs)
    bad = {**tensors, extra: tensors["model.norm.weight"]}
    with pytest.raises(NameResolutionError, match=extra):
        drive(SglangWeightTarget(model, "cpu"), manifest_of(1, bad), bad, BUCKET_BYTES)
