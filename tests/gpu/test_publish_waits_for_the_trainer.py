"""A publish reads what the trainer wrote, not what it had only queued.

The trainer (a process of its own, as deployed) queues about a second of GPU work and then
the write of version 2, and publishes at once. The sender and the receiver read its memory
from other processes, which no stream order reaches: unless ``publish`` waits for the trainer's
stream first, they read version 1's bytes while the write is still queued, checksum them, and
the receiver applies stale weights as if they were exact. With ``ready`` (an interprocess
event recorded after the write) the publish does not wait: the sender's copies wait for the
event on the GPU instead, from the stream's second version on (the first learns from the
sender's welcome that it waits).
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from tests.support import holder_module

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

_NUMEL = 64 << 20  # 256 MiB of int32
_QUEUED_CYCLES = 2_000_000_000  # about a second of one GPU's time before the write


def _trainer(address: str, mode: str, out) -> None:
    import weightsync.sender.publisher as publishing
    from weightsync.sender import Publisher

    host_waits = []
    wait_for_streams = publishing.wait_for_streams

    def counted(*args, **kwargs):
        host_waits.append(1)
        return wait_for_streams(*args, **kwargs)

    publishing.wait_for_streams = counted
    direct = mode == "direct"
    tensors = {"w": torch.ones(_NUMEL, dtype=torch.int32, device="cuda:0")}
    ready = {"w": torch.cuda.Event(interprocess=True)} if mode == "ready" else None
    with Publisher(address) as publisher:
        if ready:
            ready["w"].record()
        publisher.publish(tensors, 1, wait=True, timeout_s=120, direct=direct, ready=ready)
        torch.cuda._sleep(_QUEUED_CYCLES)
        tensors["w"].fill_(2)  # queued behind the sleep
        if ready:
            ready["w"].record()
        publisher.publish(tensors, 2, wait=True, timeout_s=120, direct=direct, ready=ready)
    out.put(("published", len(host_waits)))


def _engine(address: str, out) -> None:
    from weightsync.receiver.core import ReceiverCore
    from weightsync.receiver.torch_receiver import TorchModuleTarget

    holder = holder_module({"w": torch.zeros(_NUMEL, dtype=torch.int32, device="cuda:0")})
    receiver = ReceiverCore(TorchModuleTarget(holder), address, engine="torch")
    out.put("ready")
    for _ in range(2):
        version = receiver.sync(timeout=120)
        live = holder.state_dict()["w"]
        out.put((version, int((live != version).sum())))


@pytest.mark.parametrize("mode", ["staged", "direct", "ready"])
def test_a_publish_right_after_queued_writes_delivers_them(sock_dir, mode):
    from weightsync.sender.daemon import Sender

    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=64 << 20) as sender:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        engine = ctx.Process(target=_engine, args=(sender.address, out))
        engine.start()
        assert out.get(timeout=120) == "ready"
        trainer = ctx.Process(target=_trainer, args=(sender.address, mode, out))
        trainer.start()
        items = [out.get(timeout=180) for _ in range(3)]
        trainer.join(60)
        engine.join(60)
    # The publishes' waits for the trainer's stream on the host: with ready events only the
    # first version's (before the sender's welcome said it waits on the GPU).
    assert ("published", 1 if mode == "ready" else 2) in items, items
    # Per version the engine applied: (version, elements of the weight that differ from it).
    applied = sorted(i for i in items if isinstance(i[0], int))
    assert applied == [(1, 0), (2, 0)], items


def test_a_trainer_whose_queued_work_never_ends_gets_a_timeout_naming_its_gpu(sock_dir):
    """The wait for the trainer's stream honours the publish's timeout (a synchronize could
    not be interrupted: a hung kernel or collective hung the publish with it)."""
    from weightsync.errors import SyncTimeoutError
    from weightsync.sender import Publisher
    from weightsync.sender.daemon import Sender

    tensors = {"w": torch.ones(1024, dtype=torch.int32, device="cuda:0")}
    with Sender(f"unix:{sock_dir}/s.sock") as sender, Publisher(sender.address) as publisher:
        torch.cuda._sleep(5 * _QUEUED_CYCLES)  # a few seconds: longer than the timeout
        with pytest.raises(SyncTimeoutError, match=r"publish version 1 .*\(nothing was sent\): "
                           r"the work queued on cuda:0's current stream was not done "
                           r"within 0\.5 s"):  # fmt: skip
            publisher.publish(tensors, 1, wait=True, timeout_s=0.5)
        torch.cuda.synchronize()
        publisher.publish(tensors, 1, timeout_s=60)  # the same version, once the GPU is free
