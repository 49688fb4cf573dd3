"""Megatron TP=2 with one trainer rank per GPU: each rank writes its shards by CUDA IPC into
the sender's staging buffers on GPU 0, or (direct) the receiver reads the pieces of every
tensor in place from both GPUs; a TorchReceiver on GPU 0 must hold, bit for bit, the offline
conversion of the same shards."""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


@pytest.mark.parametrize("direct", [False, True], ids=["staged", "direct"])
def test_megatron_tp2_across_two_gpus_over_cuda_ipc(tmp_path, sock_dir, direct):
    pytest.importorskip("megatron.core")
    transformers = pytest.importorskip("transformers")
    from tests.support import megatron as ms
    from weightsync.receiver import TorchReceiver
    from weightsync.sender.daemon import Sender
    from weightsync.sender.megatron import convert_megatron_to_hf

    case = ms.CASES["qwen2_bias"]
    config = ms.hf_config(case)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).cuda()
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1 << 20) as sender:
        receiver = TorchReceiver(model, sender.address, receiver_id="hf-cuda0")
        held = []
        thread = threading.Thread(
            target=lambda: [
                (
                    receiver.sync(timeout=300),
                    held.append(
                        {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                    ),
                )
                for _ in range(ms.VERSIONS)
            ]
        )
        thread.start()
        states = ms.launch(
            tmp_path,
            {"tp": 2, "pp": 1},
            ms.publish_worker,
            "qwen2_bias",
            sender.address,
            True,
            None,
            ms.VERSIONS,
            True,
            direct,
        )[0]
        thread.join(300)
        status = sender.coordinator.status()
        # The transport each version was staged with: its slots' buffers are that kind.
        staging = {sender.coordinator.run_of(v.version).transport for v in status.versions}
    print(
        "versions:",
        [(v.version, v.state, round(v.complete_s * 1e3, 1)) for v in status.versions],
        "staging:",
        staging,
        "publishers:",
        [(p.publisher_id, p.world_size, p.device) for p in status.publishers],
    )
    last = status.versions[-1]
    print("direct bytes:", last.direct_bytes, "of", last.total_bytes, dict(last.route_bytes))
    if direct:  # every tensor's pieces tile it: nothing staged, half read from the peer GPU
        assert last.direct_bytes == last.total_bytes and last.staged_bytes == 0
        assert last.route_bytes["local"] > 0 and last.route_bytes["peer"] > 0
    else:
        assert staging == {"cuda_ipc"}
    why = [
        (v.version, v.abandoned.message, [(o.receiver_id, o.error.message) for o in v.receivers])
        for v in status.versions
        if v.state != "complete"
    ]
    assert [v.state for v in status.versions] == ["complete"] * ms.VERSIONS, why
    for version, state in enumerate(states):
        want = convert_megatron_to_hf(state, config)
        for name, tensor in want.items():
            assert torch.equal(held[version][name], tensor.cpu()), f"v{version + 1}: {name}"


@pytest.mark.parametrize("bucket_kib", [1024, 64])
def test_megatron_tp2_fp8_begun_while_each_gpu_quantizes_its_shards(tmp_path, sock_dir, bucket_kib):
    """Each rank quantizes its shards on its GPU and publishes with their launches' ready
    events (``MegatronPublisher(fp8=...)`` without ``direct``): the version begins while they
    run and the sender packs each piece once its launch is done. A TorchReceiver on GPU 0
    holding the FP8 checkpoint's names must equal ``BlockFp8`` of the gathered tensors on a
    GPU (torch on CUDA divides by a number as a product with its reciprocal, so scales made
    on a CPU can differ in their last bit). Small buckets put padding after the scales in
    slots an earlier bucket used, which the sender's writes summed before it was zeroed."""
    pytest.importorskip("megatron.core")
    from tests.support import holder_module
    from tests.support import megatron as ms
    from weightsync.fp8 import FP8, BlockFp8
    from weightsync.receiver import TorchReceiver
    from weightsync.sender.daemon import Sender
    from weightsync.sender.megatron import convert_megatron_to_hf, hf_manifest

    config = ms.hf_config(ms.FP8_CASE)
    meta = {
        s.name: torch.empty(s.shape, dtype=s.torch_dtype) for s in hf_manifest(config, "float32")
    }
    form = BlockFp8()(meta)
    model = holder_module({n: torch.zeros_like(t, device="cuda:0") for n, t in form.items()})
    fp8 = (True, None, ms.VERSIONS, True, False, True)  # cuda, fp8, not direct
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=bucket_kib << 10) as sender:
        receiver = TorchReceiver(model, sender.address, receiver_id="fp8-cuda0")
        with ms.held_versions(receiver, model, ms.VERSIONS) as held:
            states = ms.launch(
                tmp_path, {"tp": 2, "pp": 1}, ms.publish_worker, ms.FP8_CASE.name,
                sender.address, *fp8,
            )[0]  # fmt: skip
        status = sender.coordinator.status()
    assert [v.state for v in status.versions] == ["complete"] * ms.VERSIONS
    assert {sender.coordinator.run_of(v.version).transport for v in status.versions} == {"cuda_ipc"}
    for version, state in enumerate(states):
        gathered = convert_megatron_to_hf(state, config)
        want = BlockFp8()({n: t.to("cuda:0") for n, t in gathered.items()})
        assert list(held[version]) == list(want), f"version {version + 1}: names"
        for name, tensor in want.items():
            bits = torch.uint8 if tensor.dtype == FP8 else torch.int32
            got = held[version][name].cpu()
            assert torch.equal(got.view(bits), tensor.cpu().view(bits)), f"v{version + 1}: {name}"
