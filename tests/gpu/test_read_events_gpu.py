"""A receiver on another GPU than the staging buffers acks each bucket as soon as its reads
are queued, with a read event recorded behind them on the buffer's GPU
(``BucketReader._read_event``): the sender's stream waits for it before repacking the buffer,
so were the event recorded too early, or not waited for, the reads would take the next
bucket's bytes. Here every bucket's reads are slowed on the receiver's GPU (a sleep queued
before its copies): every version must still be bit-exact, and every ack carry its event. The
event's wait for the receiver's GPU must not hold the buffer GPU's current stream, where the
next bucket's crossings start.

Needs two GPUs: ``python -m pytest -m gpu tests/gpu/test_read_events_gpu.py``.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from tests.support import holder_module

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

BUCKET = 64 << 20
SLEEP_CYCLES = 10_000_000
"""About 5 ms of a GPU's clock queued before each bucket's copies: far longer than the
sender takes to repack a buffer."""


def make_tensors(version: int, device: str) -> dict[str, torch.Tensor]:
    """Six 64 MiB bf16 tensors (six buckets through two staging buffers) and a small one."""
    g = torch.Generator(device=device).manual_seed(version)
    out = {
        f"layers.{i}.weight": torch.randn(4096, 8192, generator=g, device=device).to(torch.bfloat16)
        for i in range(6)
    }
    out["norm.weight"] = torch.randn(8192, generator=g, device=device)
    return out


def _receiver(address: str, versions: int, out) -> None:
    from weightsync.receiver.core import ReceiverCore
    from weightsync.receiver.reader import BucketReader
    from weightsync.receiver.torch_receiver import TorchModuleTarget

    device = "cuda:1"
    acks = []
    release = BucketReader.release

    def noted(self, *args):
        event, unfinished = release(self, *args)
        acks.append((bool(event), unfinished is None))
        return event, unfinished

    BucketReader.release = noted

    class SlowReads(TorchModuleTarget):
        def load(self, arrival):
            torch.cuda._sleep(SLEEP_CYCLES)  # on this GPU's stream, before the copies
            return super().load(arrival)

    holder = holder_module(make_tensors(0, device))
    receiver = ReceiverCore(SlowReads(holder), address, engine="torch")
    out.put("ready")
    for _ in range(versions):
        v = receiver.sync(timeout=120)
        expected = make_tensors(v, device)
        live = holder.state_dict()
        out.put((v, [n for n in expected if not torch.equal(live[n], expected[n])]))
    out.put(acks)


def test_reads_of_another_gpus_buffer_are_acked_by_an_event_the_repack_waits_for(sock_dir):
    from weightsync.sender import Publisher
    from weightsync.sender.daemon import Sender

    versions = 3
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=BUCKET, num_buffers=2) as sender:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        proc = ctx.Process(target=_receiver, args=(sender.address, versions, out))
        proc.start()
        assert out.get(timeout=120) == "ready"
        with Publisher(sender.address) as publisher:
            for v in range(1, versions + 1):
                publisher.publish(make_tensors(v, "cuda:0"), v, wait=True, timeout_s=120)
        results = [out.get(timeout=120) for _ in range(versions)]
        acks = out.get(timeout=60)
        proc.join(60)
    assert results == [(v, []) for v in range(1, versions + 1)]
    assert len(acks) >= 6 * versions
    assert acks == [(True, True)] * len(acks)  # an event each, no ack waiting for its reads


def test_the_read_event_does_not_hold_the_buffer_gpus_current_stream():
    from weightsync.receiver.reader import BucketLoad, BucketReader, VersionReads
    from weightsync.v1 import weightsync_pb2 as pb

    reader = BucketReader(torch.device("cuda:1"), chunks_in_place=False, verify_checksums=False)
    buffer = torch.empty(1 << 20, dtype=torch.uint8, device="cuda:0")
    msg = pb.BucketAnnouncement(ready_event=b"packed", buffer=pb.BufferHandle(buffer_id="slot0"))
    torch.cuda.synchronize(0)
    with torch.cuda.device(1):
        torch.cuda._sleep(4 * 10**9)  # seconds of "reads" queued on the receiver's GPU
        reads_done = torch.cuda.Event()
        reads_done.record()
    handle, unfinished = reader.release(msg, BucketLoad({}, [], [buffer]), VersionReads(1))
    assert handle and unfinished is None
    next_crossing = torch.cuda.Event()
    next_crossing.record(torch.cuda.current_stream(0))
    next_crossing.synchronize()
    assert not reads_done.query()  # GPU 0 went on while GPU 1 still "read"
    torch.cuda.synchronize(1)
