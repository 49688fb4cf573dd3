"""MegatronPublisher end to end: real megatron-core ranks over gloo publish through a real
sender into a TorchReceiver holding a transformers model; what it holds must equal, bit for
bit, the offline conversion of the same shards (and so the TP=1 conversion, which
test_megatron_convert checks)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support import holder_module
from tests.support import megatron as ms

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.megatron

LAYOUTS = {
    "tp2": ({"tp": 2, "pp": 1}, "qwen2_bias"),
    "dp2": ({"tp": 1, "pp": 1, "dp": 2}, "qwen2_bias"),
    "pp2": ({"tp": 1, "pp": 2}, "llama_mqa_tied"),
    "pp2_vpp2": ({"tp": 1, "pp": 2, "vpp": 2}, "qwen3_qknorm"),
    "ep2": ({"tp": 1, "pp": 1, "ep": 2}, "qwen3_moe"),
    "tp2_ep2": ({"tp": 2, "pp": 1, "ep": 2, "etp": 1}, "mixtral"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_publish_reaches_a_torch_receiver_bit_exact(layout, tmp_path, sock_dir):
    from weightsync.receiver import TorchReceiver
    from weightsync.sender.daemon import Sender
    from weightsync.sender.megatron import convert_megatron_to_hf, hf_manifest

    sizes, case_name = LAYOUTS[layout]
    case = ms.CASES[case_name]
    config = ms.hf_config(case)
    if case.experts:
        # transformers fuses experts in the module; hold the per-expert checkpoint names.
        specs = hf_manifest(config, torch.float32)
        model = holder_module({s.name: torch.zeros(s.shape, dtype=s.torch_dtype) for s in specs})
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=64 * 1024) as sender:
        receiver = TorchReceiver(model, sender.address, receiver_id="hf")
        with ms.held_versions(receiver, model, ms.VERSIONS) as held:
            states = ms.launch(tmp_path, sizes, ms.publish_worker, case_name, sender.address)[0]
        versions = version_states(sender)
    assert versions == [(v, "complete") for v in range(1, ms.VERSIONS + 1)]
    for version, state in enumerate(states):
        want = convert_megatron_to_hf(state, config)
        for name, tensor in want.items():
            assert torch.equal(held[version][name], tensor), f"version {version + 1}: {name}"


def version_states(sender) -> list[tuple[int, str]]:
    return [(v.version, v.state) for v in sender.coordinator.status().versions]


@pytest.mark.parametrize("layout", ["pp2_vpp2", "ep2", "tp2_ep2"])  # tp2: on GPUs, below
def test_megatron_pieces_tile_every_tensor_so_receivers_can_read_all_of_it_in_place(
    layout, tmp_path, sock_dir
):
    """With ``direct`` and CUDA IPC, a tensor goes direct when its ranks' contiguous pieces
    tile it: in every layout here (TP shards, query groups, experts split over EP ranks) each
    tensor does, so nothing would be staged (on two GPUs, ``tests/gpu/test_megatron_cuda.py``
    reads the TP=2 case so, bit for bit; all five layouts tiled when this test was written)."""
    from weightsync.manifest import VersionManifest
    from weightsync.sender.daemon import Sender
    from weightsync.sender.planner import plan_tensors
    from weightsync.v1 import weightsync_pb2 as pb

    sizes, case_name = LAYOUTS[layout]
    with Sender(f"unix:{sock_dir}/s.sock") as sender:
        offers = ms.launch(tmp_path, sizes, ms.offer_worker, case_name, sender.address)
    specs = offers[0][0]
    begins = {rank: pb.BeginVersion.FromString(begin) for rank, (_, begin) in offers.items()}
    tensors = plan_tensors(VersionManifest(1, specs), begins, True, 64 * 1024)
    assert tensors.staged.buckets == ()
    assert [s.name for s in tensors.direct_specs] == [s.name for s in specs]


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_every_rank_offers_every_copy_it_holds_and_staging_packs_one(layout, tmp_path, sock_dir):
    """Every trainer rank a source (issue 11): both TP ranks offer their own copy of each
    replicated tensor (norms, row-parallel biases), both data-parallel replicas every tensor,
    so a receiver on either GPU finds a copy there; staging still packs each box once."""
    from weightsync.manifest import VersionManifest
    from weightsync.sender.daemon import Sender
    from weightsync.sender.offer import Offer
    from weightsync.v1 import weightsync_pb2 as pb

    sizes, case_name = LAYOUTS[layout]
    with Sender(f"unix:{sock_dir}/s.sock") as sender:
        offers = ms.launch(tmp_path, sizes, ms.offer_worker, case_name, sender.address)
    specs = offers[0][0]
    begins = {rank: pb.BeginVersion.FromString(begin) for rank, (_, begin) in offers.items()}
    offer = Offer.of(VersionManifest(1, specs), begins, {0: "gpu-a", 1: "gpu-b"})
    assert set(offer.direct) == {s.name for s in specs}
    shapes = {s.name: s.shape for s in specs}
    for name, copies in offer.direct.items():
        boxes = [sorted(c.box for c in copies if c.rank == r) for r in (0, 1)]
        assert boxes[0] and boxes[1], name  # each rank holds some of every tensor
        replicated = all(b.numel == math.prod(shapes[name]) for b in boxes[0])
        if layout == "dp2" or replicated:
            assert boxes[0] == boxes[1], name
    assert offer.covers({s.name: s for s in specs})  # one copy of each box packed


def test_without_offer_replicas_only_the_replica_that_sends_offers(tmp_path, sock_dir):
    from weightsync.sender.daemon import Sender
    from weightsync.v1 import weightsync_pb2 as pb

    sizes, case_name = LAYOUTS["dp2"]
    with Sender(f"unix:{sock_dir}/s.sock") as sender:
        offers = ms.launch(tmp_path, sizes, ms.offer_worker, case_name, sender.address, False)
    pieces = {rank: pb.BeginVersion.FromString(begin).pieces for rank, (_, begin) in offers.items()}
    assert {p.name for p in pieces[0]} == {s.name for s in offers[0][0]} and not pieces[1]
