"""Issue 33 on GPUs: a late engine on GPU 1 catches up from a peer engine's parameters on
GPU 0 (CUDA IPC staging: the source packs its live tensors into the staging buffer, the late
engine reads them over NVLink), bit-exact, while the trainer's tensors changed in place after
the publish. Prints the catch-up's time beside a plain copy of the same bytes GPU 0 -> GPU 1
(the floor docs/benchmarks.md reports it against).

Run on a GPU machine with two GPUs: ``python -m pytest -m gpu tests/gpu -s``.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from tests.gpu.test_cuda_ipc import BUCKET, GIB, make_tensors
from tests.support import holder_module

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def _engine(address: str, rid: str, device: str, out) -> None:
    from weightsync.receiver.core import ReceiverCore
    from weightsync.receiver.torch_receiver import TorchModuleTarget

    holder = holder_module(make_tensors(0, device))
    receiver = ReceiverCore(TorchModuleTarget(holder), address, engine="torch", receiver_id=rid)
    out.put((rid, "ready"))
    v = receiver.sync(timeout=120)
    expected = make_tensors(v, device)
    live = holder.state_dict()
    out.put((rid, v, all(torch.equal(live[n], expected[n]) for n in expected)))
    out.put((rid, "done", receiver.sync(timeout=120)))


def _copy_floor(nbytes_like: dict[str, torch.Tensor]) -> float:
    src = {n: t for n, t in nbytes_like.items()}
    dst = {n: torch.empty_like(t, device="cuda:1") for n, t in src.items()}
    times = []
    for _ in range(5):
        torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
        start = time.perf_counter()
        for n in src:
            dst[n].copy_(src[n], non_blocking=True)
        torch.cuda.synchronize("cuda:1")
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def test_a_late_engine_on_another_gpu_catches_up_from_a_peer_engine(sock_dir):
    from weightsync.sender import Publisher
    from weightsync.sender.daemon import Sender

    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=BUCKET, transport="auto") as sender:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        source = ctx.Process(target=_engine, args=(sender.address, "source", "cuda:0", out))
        source.start()
        assert out.get(timeout=120) == ("source", "ready")
        publisher = Publisher(sender.address)
        tensors = make_tensors(1, "cuda:0")
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        publisher.publish(tensors, 1, wait=True, timeout_s=120)
        assert out.get(timeout=120) == ("source", 1, True)
        for t in tensors.values():
            t.add_(1)  # training goes on: the trainer's memory is no source now
        late = ctx.Process(target=_engine, args=(sender.address, "late", "cuda:1", out))
        late.start()
        assert out.get(timeout=120) == ("late", "ready")
        assert out.get(timeout=120) == ("late", 1, True)
        (record,) = publisher.status().catch_ups
        assert (record.receiver_id, record.source, record.route, record.state) == (
            "late",
            "receiver source",
            "peer",
            "complete",
        )
        assert record.bytes == nbytes
        floor = _copy_floor(tensors)
        print(
            f"catch-up of {nbytes / GIB:.2f} GiB, GPU 0 engine -> GPU 1 engine: "
            f"{record.complete_s * 1e3:.1f} ms; plain copy GPU 0 -> GPU 1 {floor * 1e3:.1f} ms "
            f"({record.complete_s / floor:.2f}x)"
        )
        publisher.publish(make_tensors(2, "cuda:0"), 2, wait=True, timeout_s=120)
        done = sorted(out.get(timeout=120) for _ in range(2))
        assert done == [("late", "done", 2), ("source", "done", 2)]
        for p in (source, late):
            p.join(60)
