"""DeepSeek-V3 trained in megatron-core, received by SGLang's DeepSeek classes, version after
version.

SGLang splits ``kv_b_proj`` into the absorbed MLA matrices ``w_kc`` / ``w_vc`` after loading
(``post_load_weights``); they are plain attributes, neither parameters nor buffers, so a
receiver that only rewrote parameters would leave them at version 1 while ``kv_b_proj`` moves
on. After each version, every parameter, buffer and ``w_kc`` / ``w_vc`` must equal a fresh
SGLang model loaded by SGLang's own loader from that version's tensors.

The SGLang venv has no megatron-core: the main venv (``.venv``) builds the model at TP=2 over
gloo, converts two versions by the sender's code path and saves them
(``tests.support.megatron.save_converted_versions``); this test drives them through
``SglangWeightTarget`` in chunked buckets. Nothing runs forward (tests/support/sglang.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.sglang import install_cpu_shims

install_cpu_shims()  # before transformers or SGLang import torchvision

from tests.support import drive, manifest_of  # noqa: E402
from tests.sweeps.archs import differing, live_tensors  # noqa: E402

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[2]
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
CASE = "deepseek_v3"
NUM_LAYERS = 4
"""The case's decoder layers; its MTP layer is ``model.layers.4``."""
BUCKET_BYTES = 64 * 1024  # several buckets per version, kv_b_proj and experts chunked
SENTINEL = -7.0
"""Every parameter starts here: the draft's embed_tokens / lm_head, which SGLang shares with the
target model (``set_embed_and_head``) and a version does not carry, stay equal."""


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> list[dict[str, torch.Tensor]]:
    """Two versions of the Megatron model's HF tensors (MTP layer included)."""
    from safetensors.torch import load_file

    if not MAIN_PYTHON.exists():
        pytest.skip(f"{MAIN_PYTHON} (the main venv, with megatron-core) is not set up")
    out = tmp_path_factory.mktemp("megatron")
    code = (
        "from tests.support.megatron import save_converted_versions as save; "
        f"save({CASE!r}, {str(out)!r})"
    )
    done = subprocess.run(
        [str(MAIN_PYTHON), "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [load_file(out / f"v{v}.safetensors") for v in (1, 2)]


def sglang_config():
    from tests.support import megatron as ms

    config = ms.hf_config(ms.CASE_BY_NAME[CASE])
    config.dtype = torch.float32
    # SGLang's DeepSeek class reads these; transformers' config lacks them.
    config.moe_layer_freq = 1
    config.scoring_func = "sigmoid"
    config.topk_method = "noaux_tc"
    return config


def build(cls) -> torch.nn.Module:
    from tests.support.sglang import init_sglang

    init_sglang()
    with torch.device("cpu"):
        model = cls(config=sglang_config(), quant_config=None)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(SENTINEL)
    return model


def sglang_load(cls, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A fresh model loaded by SGLang's own loader and post-processing."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    model = build(cls)
    with torch.no_grad():
        DefaultModelLoader.load_weights_and_postprocess(
            model, ((n, t.clone()) for n, t in tensors.items()), torch.device("cpu")
        )
    return model


def absorbed(attentions: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{w}": getattr(a, w).clone()
        for i, a in enumerate(attentions)
        for w in ("w_kc", "w_vc")
    }


def receive_versions(cls, versions, attentions) -> None:
    """Drive each version into one live model; after each, compare with a fresh load."""
    from weightsync.receiver.sglang.target import SglangWeightTarget

    model = build(cls)
    target = SglangWeightTarget(model, "cpu")
    previous = None
    for version, tensors in enumerate(versions, start=1):
        drive(target, manifest_of(version, tensors), tensors, BUCKET_BYTES)
        reference = sglang_load(cls, tensors)
        wrong = differing(live_tensors(model).items(), live_tensors(reference).items())
        assert not wrong, f"version {version}: {len(wrong)} live tensors differ, e.g. {wrong[:4]}"
        got = absorbed(attentions(model))
        assert not differing(got.items(), absorbed(attentions(reference)).items()), version
        if previous is not None:  # the new kv_b_proj moved them: a stale copy would show
            assert all(not torch.equal(got[k], previous[k]) for k in got)
        previous = got


def test_target_model_refreshes_w_kc_w_vc_every_version(versions):
    from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM

    mtp = f"model.layers.{NUM_LAYERS}."
    main = [{k: t for k, t in v.items() if not k.startswith(mtp)} for v in versions]
    assert "model.layers.0.self_attn.q_a_proj.weight" in main[0]
    receive_versions(
        DeepseekV3ForCausalLM, main, lambda m: [layer.self_attn for layer in m.model.layers]
    )


def test_mtp_draft_model_receives_the_megatron_mtp_layer(versions):
    """SGLang's NextN draft class (its speculative draft worker's model) takes the Megatron MTP
    layer under DeepSeek-V3's checkpoint names, absorbed matrices included."""
    from sglang.srt.models.deepseek_nextn import DeepseekV3ForCausalLMNextN

    mtp = [
        {k: t for k, t in v.items() if k.startswith(f"model.layers.{NUM_LAYERS}.")}
        for v in versions
    ]
    assert f"model.layers.{NUM_LAYERS}.eh_proj.weight" in mtp[0]
    receive_versions(DeepseekV3ForCausalLMNextN, mtp, lambda m: [m.model.decoder.self_attn])
