"""Megatron with one trainer rank per GPU (TP=2, or TP=1 x DP=2) and a TorchReceiver on each
GPU: each rank writes its shards by CUDA IPC into the sender's staging buffers on GPU 0, or
(direct) each receiver reads every tensor in place from the copies nearest it; every receiver
must hold, bit for bit, the offline conversion of the same shards."""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

CASES = {
    "tp2-staged": ({"tp": 2, "pp": 1}, False),
    "tp2-direct": ({"tp": 2, "pp": 1}, True),
    "dp2-direct": ({"tp": 1, "pp": 1, "dp": 2}, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_ranks_on_two_gpus_feed_a_receiver_on_each_over_cuda_ipc(tmp_path, sock_dir, case):
    pytest.importorskip("megatron.core")
    transformers = pytest.importorskip("transformers")
    from tests.support import megatron as ms
    from weightsync.receiver import TorchReceiver
    from weightsync.sender.daemon import Sender
    from weightsync.sender.megatron import convert_megatron_to_hf

    sizes, direct = CASES[case]
    config = ms.hf_config(ms.CASES["qwen2_bias"])
    models = [
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(f"cuda:{g}")
        for g in range(2)
    ]
    held: list[list[dict]] = [[], []]

    def receive(receiver, model, out):
        torch.cuda.set_device(model.device)  # as an engine's worker does, per thread here
        for _ in range(ms.VERSIONS):
            receiver.sync(timeout=300)
            out.append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})

    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1 << 20) as sender:
        threads = [
            threading.Thread(
                target=receive,
                args=(TorchReceiver(m, sender.address, receiver_id=f"hf-cuda{g}"), m, held[g]),
            )
            for g, m in enumerate(models)
        ]
        for t in threads:
            t.start()
        states = ms.launch(
            tmp_path,
            sizes,
            ms.publish_worker,
            "qwen2_bias",
            sender.address,
            True,
            None,
            ms.VERSIONS,
            True,
            direct,
        )[0]
        for t in threads:
            t.join(300)
        status = sender.coordinator.status()
        staging = {s.buffer.handle.WhichOneof("kind") for s in sender.coordinator.staging_slots()}
    print(
        "versions:",
        [(v.version, v.state, round(v.complete_s * 1e3, 1)) for v in status.versions],
        "staging:",
        staging,
        "publishers:",
        [(p.publisher_id, p.world_size, p.device) for p in status.publishers],
    )
    last = status.versions[-1]
    routes = dict(last.route_bytes)
    print("direct bytes:", last.direct_bytes, "of", last.total_bytes, routes)
    why = [
        (v.version, v.abandoned.message, [(o.receiver_id, o.error.message) for o in v.receivers])
        for v in status.versions
        if v.state != "complete"
    ]
    assert [v.state for v in status.versions] == ["complete"] * ms.VERSIONS, why
    if not direct:
        assert staging == {"cuda_ipc"}
    elif sizes["tp"] == 1:  # each GPU holds a whole replica: nothing crosses NVLink
        assert last.direct_bytes == last.total_bytes and last.staged_bytes == 0
        assert routes.get("peer", 0) == 0 and routes["local"] == 2 * last.total_bytes
    else:  # half of each split tensor from the peer; replicated ones from each GPU's own copy
        assert last.direct_bytes == last.total_bytes and last.staged_bytes == 0
        assert routes["local"] > routes["peer"] > 0
    for version, state in enumerate(states):
        want = convert_megatron_to_hf(state, config)
        for g in range(2):
            for name, tensor in want.items():
                assert torch.equal(held[g][version][name], tensor.cpu()), (
                    f"v{version + 1} {g}: {name}"
                )
