"""cuda_ipc end to end on real GPUs: receivers on the trainer's GPU and on another GPU.

Run on a GPU machine: ``python -m pytest -m gpu tests/gpu -s`` (CI skips the ``gpu`` marker).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from tests.support import holder_module

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GIB = 1 << 30
BUCKET = 256 << 20


def make_tensors(version: int, device: str) -> dict[str, torch.Tensor]:
    """About 1.1 GiB, mixed dtypes, one tensor larger than a bucket (chunked)."""
    g = torch.Generator(device=device).manual_seed(version)
    out = {
        f"layers.{i}.weight": torch.randn(4096, 8192, generator=g, device=device).to(torch.bfloat16)
        for i in range(8)
    }
    # 312 MiB fp32, larger than a bucket: chunked.
    out["embed.weight"] = torch.randn(40000, 2048, generator=g, device=device)
    out["norm.weight"] = torch.randn(8192, generator=g, device=device)
    out["router.bias"] = torch.randint(0, 1 << 40, (64,), generator=g, device=device)
    return out


def _receiver(address: str, device: str, versions: int, out) -> None:
    from weightsync import summed_copies
    from weightsync.receiver.core import ReceiverCore
    from weightsync.receiver.torch_receiver import TorchModuleTarget

    landed = []  # whether the reads were checksummed where they landed (another GPU's bucket)
    run = summed_copies.LandedSums.run
    summed_copies.LandedSums.run = lambda self: landed.append(True) or run(self)
    holder = holder_module(make_tensors(0, device))
    receiver = ReceiverCore(TorchModuleTarget(holder), address, engine="torch")
    out.put("ready")
    for _ in range(versions):
        v = receiver.sync(timeout=120)
        expected = make_tensors(v, device)
        live = holder.state_dict()
        exact = all(torch.equal(live[n], expected[n]) for n in expected)
        out.put((device, v, exact, bool(landed)))


@pytest.mark.parametrize("mode", ["staged", "direct", "nccl"])
def test_bit_exact_on_the_same_gpu_and_across_gpus(sock_dir, mode):
    from weightsync.sender import Publisher
    from weightsync.sender.daemon import Sender

    two = torch.cuda.device_count() > 1
    if mode == "nccl" and not two:
        pytest.skip("nccl needs a second GPU (NCCL refuses two ranks on one GPU)")
    devices = {"staged": ["cuda:0", "cuda:1"], "direct": ["cuda:0", "cuda:1"], "nccl": ["cuda:1"]}[
        mode
    ][: 2 if two else 1]
    versions = 3
    transport = "nccl" if mode == "nccl" else "auto"
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=BUCKET, transport=transport) as sender:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [
            ctx.Process(target=_receiver, args=(sender.address, d, versions, out)) for d in devices
        ]
        for p in procs:
            p.start()
        for _ in devices:
            assert out.get(timeout=120) == "ready"
        publisher = Publisher(sender.address)
        for v in range(1, versions + 1):
            tensors = make_tensors(v, "cuda:0")
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = publisher.publish(
                tensors, v, wait=True, timeout_s=120, direct=mode == "direct"
            )
            elapsed = time.perf_counter() - start
            status = result.status
            print(
                f"{mode} version {v}: {nbytes / GIB:.2f} GiB to {devices}: staged "
                f"{result.staged_s * 1e3:.1f} ms, applied {elapsed * 1e3:.1f} ms, "
                f"{nbytes / elapsed / 1e9:.1f} GB/s; direct {status.direct_bytes / GIB:.2f} GiB"
            )
            assert status.direct_bytes == (nbytes if mode == "direct" else 0)
        results = [out.get(timeout=120) for _ in range(versions * len(devices))]
        for p in procs:
            p.join(60)
        assert all(ok for _, _, ok, _ in results), results
        assert sorted((d, v) for d, v, _, _ in results) == sorted(
            (d, v) for d in devices for v in range(1, versions + 1)
        )
        # Staged reads into another GPU than the bucket's are checksummed where they landed.
        assert {d for d, _, _, landed in results if landed} == {
            d for d in devices if mode == "staged" and d != "cuda:0"
        }
        assert {r.data_path for r in publisher.status().receivers} == {
            "broadcast" if mode == "nccl" else "map"
        }


def test_floor_for_reference():
    """Prints a device-to-device copy of the same bytes, the floor the numbers above face."""
    src = make_tensors(1, "cuda:0")
    nbytes = sum(t.numel() * t.element_size() for t in src.values())
    dst = {n: torch.empty_like(t) for n, t in src.items()}
    for _ in range(3):
        for n in src:
            dst[n].copy_(src[n])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for n in src:
        dst[n].copy_(src[n])
    torch.cuda.synchronize()
    floor = time.perf_counter() - start
    print(
        f"floor: D2D copy of {nbytes / GIB:.2f} GiB: {floor * 1e3:.2f} ms, "
        f"{nbytes / floor / 1e9:.1f} GB/s"
    )
    assert all(torch.equal(dst[n], src[n]) for n in src)
