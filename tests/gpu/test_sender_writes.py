"""The sender writing the weights of a receiver on its staging GPU (protocol §4.3), end to end:
a real engine-side receiver in its own process offers its weights, the sender in this process
packs each bucket and writes it into them (in the pack's own launch, or from the slot behind
it), the receiver reads nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch

from tests.gpu.test_cuda_ipc import BUCKET, make_tensors
from tests.support import holder_module

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _receiver(address: str, versions: int, writes: bool, out, max_sources: int = 0) -> None:
    os.environ["WEIGHTSYNC_RECEIVER_SENDER_WRITES"] = str(writes).lower()
    from weightsync import limits
    from weightsync.receiver.core import ReceiverCore

    if max_sources:
        limits.MAX_SOURCES = max_sources  # its weights lie in more storages than this
    from weightsync.receiver.torch_receiver import TorchModuleTarget

    holder = holder_module(make_tensors(0, "cuda:0"))
    receiver = ReceiverCore(TorchModuleTarget(holder), address, engine="torch")
    out.put(receiver.receiver_id)
    for _ in range(versions):
        try:
            v = receiver.sync(timeout=120)
        except Exception as e:
            out.put((type(e).__name__, str(e), receiver.dirty))
            continue
        expected = make_tensors(v, "cuda:0")
        live = holder.state_dict()
        out.put((v, all(torch.equal(live[n], expected[n]) for n in expected)))


def _run(
    sock_dir,
    monkeypatch,
    writes: bool,
    corrupt_version: int = 0,
    fuse: bool = True,
    max_sources: int = 0,
) -> tuple[list, dict, dict]:
    """Publish 3 versions to a receiver on GPU 0; returns what it reported per version and,
    per version, each bucket packed and whether the sender wrote it into the weights (as
    many as its status counts), and whether it did so in the pack's own launch (``fuse``:
    let it)."""
    from weightsync.sender import Publisher
    from weightsync.sender import writes as writes_module
    from weightsync.sender.daemon import Sender
    from weightsync.sender.writes import Writes
    from weightsync.summed_copies import SummedCopies

    written: dict[int, dict[int, bool]] = {}
    fused: dict[int, dict[int, bool]] = {}
    pack, pack_bucket = Writes.pack, writes_module.pack_bucket

    def spy(self, version, bucket, slot, staged):
        sums, wrote = pack(self, version, bucket, slot, staged)
        written.setdefault(version.version, {})[bucket.index] = bool(wrote)
        return sums, wrote

    def spy_pack(version, bucket, slot, also=None):
        def recorded(copies):
            batch = also(copies)
            fused.setdefault(version.version, {})[bucket.index] = batch is not None
            return batch

        sums = pack_bucket(version, bucket, slot, recorded if also else None)
        if version.version == corrupt_version and bucket.index == 2:
            slot.buffer.tensor[0] ^= 1  # the staging overwritten between the pack and the write
        return sums

    monkeypatch.setattr(Writes, "pack", spy)
    monkeypatch.setattr(writes_module, "pack_bucket", spy_pack)
    if not fuse:
        monkeypatch.setattr(SummedCopies, "also", lambda self, moves: None)
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=BUCKET) as sender:
        out = mp.get_context("spawn").Queue()
        proc = mp.get_context("spawn").Process(
            target=_receiver, args=(sender.address, 3, writes, out, max_sources)
        )
        proc.start()
        out.get(timeout=120)  # registered
        with Publisher(sender.address) as publisher:
            for v in (1, 2, 3):
                try:
                    publisher.publish(make_tensors(v, "cuda:0"), v, wait=True, timeout_s=120)
                except Exception:
                    if v != corrupt_version:
                        raise
            counted = {
                s.version: sum(o.written_buckets for o in s.receivers)
                for s in publisher.status().versions
            }
        reports = [out.get(timeout=120) for _ in range(3)]
        proc.join(60)
    assert counted == {v: sum(b.values()) for v, b in written.items()}, (counted, written)
    return reports, written, fused


@pytest.mark.parametrize(
    ("writes", "fuse", "max_sources"),
    [(True, True, 0), (True, False, 0), (False, True, 0), (True, True, 1)],
    ids=[
        "sender-writes-in-the-pack",
        "sender-writes-from-the-slot",
        "receiver-reads",
        "receiver-reads-weights-in-more-storages-than-an-offer-names",
    ],
)
def test_a_receiver_on_the_staging_gpu_gets_exact_weights_written_by_the_sender(
    sock_dir, monkeypatch, writes, fuse, max_sources
):
    reports, written, fused = _run(
        sock_dir, monkeypatch, writes, fuse=fuse, max_sources=max_sources
    )
    writes = writes and not max_sources  # over the limit it offers nothing: it reads
    assert reports == [(1, True), (2, True), (3, True)]
    for version, buckets in written.items():
        assert len(buckets) > 2, written  # the rest of this test needs a bucket past the slots
        # The first two buckets may be packed before the verdict that lets the sender write
        # comes (two staging slots); the third waits for the ack of the first, behind it.
        later = [i for i in buckets if i >= 2]
        assert all(buckets[i] == writes for i in later), (version, buckets)
        # Every tensor is one contiguous run in the receiver's weights: the pack writes it.
        assert all(fused.get(version, {}).get(i, False) == (writes and fuse) for i in later), (
            version,
            fused,
        )


def test_a_written_bucket_that_differs_from_the_packed_one_fails_the_receiver_dirty(
    sock_dir, monkeypatch
):
    reports, written, _ = _run(sock_dir, monkeypatch, True, corrupt_version=2, fuse=False)
    assert written[2][2], written
    assert reports[0] == (1, True)
    name, message, dirty = reports[1]
    assert name == "ReceiverFailedError", reports[1]
    assert "bucket 2" in message and "as the sender wrote it" in message, message
    assert dirty
    assert reports[2] == (3, True)  # the next version heals it


def test_a_receiver_killed_while_the_sender_writes_its_weights_leaves_the_sender_working(
    sock_dir, monkeypatch
):
    """The sender writes into memory another process owns. Killed before the sender queues
    its writes of bucket 3, the receiver fails version 2 alone; the writes into its dead
    memory do not fault the sender's GPU context (that would fail every later version), and
    a receiver started next gets version 3 exactly."""
    from weightsync.errors import ReceiverFailedError
    from weightsync.sender import Publisher
    from weightsync.sender.daemon import Sender
    from weightsync.sender.writes import Writes

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    killed: list[int] = []
    pack = Writes.pack

    def killing(self, version, bucket, slot, staged):
        if version.version == 2 and bucket.index == 3 and self.granted and not killed:
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(30)  # its CUDA context is gone before the writes are queued
            killed.append(bucket.index)
        return pack(self, version, bucket, slot, staged)

    monkeypatch.setattr(Writes, "pack", killing)
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=BUCKET) as sender:
        victim = ctx.Process(target=_receiver, args=(sender.address, 3, True, out))
        victim.start()
        victim_id = out.get(timeout=120)
        with Publisher(sender.address) as publisher:
            publisher.publish(make_tensors(1, "cuda:0"), 1, wait=True, timeout_s=120)
            assert out.get(timeout=120) == (1, True)
            with pytest.raises(ReceiverFailedError, match=victim_id):
                publisher.publish(make_tensors(2, "cuda:0"), 2, wait=True, timeout_s=120)
            assert killed == [3]
            survivor = ctx.Process(target=_receiver, args=(sender.address, 2, True, out))
            survivor.start()
            out.get(timeout=120)  # registered
            publisher.publish(make_tensors(3, "cuda:0"), 3, wait=True, timeout_s=120)
            got = out.get(timeout=120)
            if got[0] == 2:  # a catch-up to the version it missed came first
                assert got == (2, True)
                got = out.get(timeout=120)
            assert got == (3, True)
            survivor.kill()
            survivor.join(30)
    torch.cuda.synchronize()  # no fault is pending on this process's GPU
