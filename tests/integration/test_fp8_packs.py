"""``Fp8Packs`` (issue 36): a trainer's bf16 weights published as block FP8, each quantized
into the bucket the sender asks the publisher to pack. The receiver must hold exactly what
``BlockFp8`` makes of the same tensors, every version, whichever way the buckets cut the
weights: values and scales in one bucket (quantized straight into it), a weight's values and
scales in different buckets, a weight chunked over buckets (quantized whole, then copied).
On the CPU over shared memory (torch's ops quantize) and, marked ``gpu``, on CUDA (the block
FP8 kernel's launches into the sender's staging slots, over CUDA IPC):
``python -m pytest -m gpu tests/integration/test_fp8_packs.py``."""

from __future__ import annotations

import pytest
import torch

from tests.support import holder_module, sync_in_thread
from tests.support.devices import DEVICES
from weightsync.buckets import TensorSpec, plan_buckets
from weightsync.errors import ConfigError
from weightsync.fp8 import BlockFp8, scale_name
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher
from weightsync.sender.daemon import Sender
from weightsync.sender.fp8_packs import Fp8Packs

BUCKET = 64 * 1024

SHAPES = {
    "embed_tokens.weight": ((96, 64), torch.bfloat16),  # not quantized: as it is
    "layers.0.q_proj.weight": ((256, 128), torch.bfloat16),  # whole blocks
    "layers.0.o_proj.weight": ((200, 130), torch.bfloat16),  # ragged blocks
    "layers.0.k_proj.weight": ((256, 256), torch.bfloat16),  # a bucket of e4m3: scales apart
    "layers.0.up_proj.weight": ((512, 256), torch.bfloat16),  # 128 KiB of e4m3: chunked
    "layers.0.down_proj.weight": ((128, 384), torch.float32),  # float32 weights quantize too
    "norm.weight": ((64,), torch.float32),
}


def _trainer(version: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        name: (torch.randn(shape, generator=g) * 0.02).to(device, dtype)
        for name, (shape, dtype) in SHAPES.items()
    }


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_the_buckets_cut_the_weights_every_way_the_pack_handles():
    """The plan of this test's model puts values and scales together, apart, and chunked:
    the cases below are all exercised."""
    form = BlockFp8()(_trainer(1))
    buckets = plan_buckets([TensorSpec.of(n, t) for n, t in form.items()], BUCKET).buckets
    where: dict[str, set[int]] = {}
    for bucket in buckets:
        for entry in bucket.entries:
            where.setdefault(entry.name, set()).add(bucket.index)
    weights = [n for n in SHAPES if n.endswith("_proj.weight")]
    together = [w for w in weights if where[w] == where[scale_name(w)] and len(where[w]) == 1]
    apart = [w for w in weights if len(where[w]) == 1 and where[w] != where[scale_name(w)]]
    chunked = [w for w in weights if len(where[w]) > 1]
    assert together and apart and chunked, (together, apart, chunked)


@pytest.mark.parametrize("device", DEVICES)
def test_every_version_holds_what_block_fp8_makes_of_the_trainers_weights(tmp_path, device):
    expected = BlockFp8()
    receiving = {n: torch.zeros_like(t) for n, t in expected(_trainer(0, device)).items()}
    model = holder_module(receiving)
    packs = Fp8Packs()
    versions = 3
    with (
        Sender(f"unix:{tmp_path}/s.sock", bucket_size_bytes=BUCKET) as sender,
        Publisher(sender.address) as publisher,
    ):
        receiver = TorchReceiver(model, sender.address, receiver_id="fp8")
        try:
            trainer = _trainer(1, device)
            for version in range(1, versions + 1):
                thread, _ = sync_in_thread(receiver)
                for name, value in _trainer(version, device).items():
                    trainer[name].copy_(value)  # the trainer's step, in place
                result = packs.publish(publisher, trainer, version, wait=True, timeout_s=60)
                assert thread.finish(60) == [version]
                assert not result.status.sender_packed  # the publisher packed every bucket
                want = expected(trainer)
                held = model.state_dict()
                assert list(held) == list(want)
                wrong = [n for n, t in want.items() if not torch.equal(_bytes(held[n]), _bytes(t))]
                assert not wrong, f"version {version}: {wrong} differ from BlockFp8's"
        finally:
            receiver.close()


def test_a_picked_tensor_that_is_no_weight_is_named_before_anything_is_sent(tmp_path):
    packs = Fp8Packs(BlockFp8(lambda name, t: name == "norm.weight"))
    with (
        Sender(f"unix:{tmp_path}/s.sock", bucket_size_bytes=BUCKET) as sender,
        Publisher(sender.address) as publisher,
    ):
        with pytest.raises(ValueError, match=r"'norm.weight' is \(64,\) torch.float32"):
            packs.publish(publisher, _trainer(1), 1, timeout_s=60)
        assert not publisher.status().versions  # nothing began


@pytest.mark.parametrize(
    ("tensors", "error"),
    [
        ({}, "no tensors"),
        (
            {"a.weight": torch.zeros(2, 2), "b.weight": torch.zeros(2, 2, device="meta")},
            "'a.weight' on cpu, 'b.weight' on meta",
        ),
    ],
)
def test_tensors_of_no_device_or_of_two_are_refused_naming_them(tmp_path, tensors, error):
    with (
        Sender(f"unix:{tmp_path}/s.sock", bucket_size_bytes=BUCKET) as sender,
        Publisher(sender.address) as publisher,
    ):
        with pytest.raises(ConfigError, match=error):
            Fp8Packs().publish(publisher, tensors, 1, timeout_s=60)


def test_one_rank_of_several_is_pointed_to_the_megatron_publisher(tmp_path):
    with (
        Sender(f"unix:{tmp_path}/s.sock", bucket_size_bytes=BUCKET) as sender,
        Publisher(sender.address, rank=1, world_size=2) as publisher,
    ):
        with pytest.raises(ConfigError, match=r"rank 1 of 2.*MegatronPublisher"):
            Fp8Packs().publish(publisher, _trainer(1), 1, timeout_s=60)
