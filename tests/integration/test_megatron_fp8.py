"""Block FP8 from every Megatron rank (issue 36): real megatron-core ranks over gloo, each
quantizing its own shards, publish through a real sender into a TorchReceiver holding the FP8
checkpoint's names; what it holds must equal, bit for bit, ``BlockFp8`` applied to the HF
tensors gathered from the same shards (values, scales and names). A layout whose TP split
cuts the 128 x 128 blocks is refused on every rank, naming the tensor and the piece."""

from __future__ import annotations

import pytest
import torch

from tests.support import holder_module
from tests.support import megatron as ms

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("sizes", [{"tp": 2, "pp": 1}, {"tp": 2, "pp": 2}], ids=["tp2", "tp2_pp2"])
def test_ranks_quantize_their_shards_as_block_fp8_of_the_gathered_tensors(
    sizes, tmp_path, sock_dir
):
    from weightsync.fp8 import FP8, BlockFp8
    from weightsync.receiver import TorchReceiver
    from weightsync.sender.daemon import Sender
    from weightsync.sender.megatron import convert_megatron_to_hf, hf_manifest

    config = ms.hf_config(ms.FP8_CASE)
    meta = {
        s.name: torch.empty(s.shape, dtype=s.torch_dtype) for s in hf_manifest(config, "float32")
    }
    form = BlockFp8()(meta)
    model = holder_module({n: torch.zeros_like(t) for n, t in form.items()})
    fp8 = (False, None, ms.VERSIONS, True, False, True)  # publish_worker's fp8=True
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=64 * 1024) as sender:
        receiver = TorchReceiver(model, sender.address, receiver_id="fp8")
        with ms.held_versions(receiver, model, ms.VERSIONS) as held:
            states = ms.launch(
                tmp_path, sizes, ms.publish_worker, ms.FP8_CASE.name, sender.address, *fp8
            )[0]
    assert sum(t.dtype == FP8 for t in form.values()) == 7 * ms.FP8_CASE.num_layers
    for version, state in enumerate(states):
        want = BlockFp8()(convert_megatron_to_hf(state, config))
        assert list(held[version]) == list(want), f"version {version + 1}: names"
        for name, tensor in want.items():
            got = held[version][name]
            assert got.dtype == tensor.dtype, f"version {version + 1}: {name}"
            bits = torch.uint8 if tensor.dtype == FP8 else torch.int32
            assert torch.equal(got.view(bits), tensor.view(bits)), f"version {version + 1}: {name}"


def test_a_tp_split_that_cuts_the_blocks_is_refused_on_every_rank_naming_the_tensor(tmp_path):
    """qwen2_bias at TP=2: each rank's query group is 2 heads of 32 rows, 64 of the 128
    rows of a block."""
    fp8 = (False, None, 1, True, False, True)
    with pytest.raises(AssertionError) as failed:
        ms.launch(tmp_path, {"tp": 2, "pp": 1}, ms.publish_worker, "qwen2_bias", "unix:none", *fp8)
    text = str(failed.value)
    assert text.count("PlanError: planning the Megatron -> HF conversion failed") == 2
    assert (
        "block FP8: HF tensor 'model.layers.0.self_attn.q_proj.weight' (128, 128) gets rows 0:64 "
        "and columns 0:128 from Megatron parameter 'decoder.layers.0.self_attention."
        "linear_qkv.weight' on this rank, a 64 x 128 piece whose edge cuts the 128 x 128 blocks"
    ) in text
