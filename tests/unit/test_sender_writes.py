"""The sender's side of writing a receiver's weights (protocol §4.3), without a GPU: which
offers it takes, how a written bucket that differs from the packed one is reported, and the
pack's table that writes the weights too, run by the kernel's source on the CPU
(``tests/support/cuda_on_cpu.py``). The writes end to end run on a GPU:
tests/gpu/test_sender_writes.py."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from tests.support import cuda_on_cpu
from weightsync.buckets import TensorSpec, plan_buckets
from weightsync.checksum import finish, finish_all, row_sums
from weightsync.errors import ConfigError
from weightsync.limits import check_receiver_message
from weightsync.regions import Region, region_copies
from weightsync.sender.writes import Offered, Writes, _batch, map_offer
from weightsync.summed_copies import SummedCopies, plan_rows, spans_of, table
from weightsync.v1 import weightsync_pb2 as pb


def test_an_offer_of_anything_but_cuda_ipc_memory_is_not_taken_and_says_why(caplog):
    offer = pb.WriteOffer(
        key=b"w1",
        sources=[pb.BufferHandle(buffer_id="b", nbytes=64, shm=pb.ShmHandle(path="/etc/passwd"))],
    )
    with caplog.at_level(logging.WARNING, "weightsync.sender"):
        assert map_offer(offer, "engine-0") is None
    assert "receiver engine-0: its write offer is not taken" in caplog.text
    assert "WriteOffer.sources[0] is not CUDA IPC memory" in caplog.text


def test_a_written_bucket_whose_sum_differs_from_the_packed_one_names_receiver_and_bucket():
    tensors = {"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(32)}
    plan = plan_buckets(tuple(TensorSpec.of(n, t) for n, t in tensors.items()), 256)
    buffers = [torch.randint(0, 255, (256,), dtype=torch.uint8) for _ in plan.buckets]
    packed = finish_all(
        [row_sums(b, k.nbytes) for b, k in zip(buffers, plan.buckets, strict=True)],
        [k.nbytes for k in plan.buckets],
    )
    writes = Writes()
    for bucket, buffer in zip(plan.buckets, buffers, strict=True):
        writes.sums[("good", bucket.index)] = (row_sums(buffer, bucket.nbytes), bucket)
    last = plan.buckets[-1]
    flipped = buffers[-1].clone()
    flipped[0] ^= 1
    writes.sums[("bad", last.index)] = (row_sums(flipped, last.nbytes), last)
    version = SimpleNamespace(checksums=packed, active=lambda: ["good", "bad"])
    ((rid, error),) = writes.differ(version)
    assert writes.differ(SimpleNamespace(checksums=packed, active=lambda: ["good"])) == []
    assert rid == "bad"
    assert f"bucket {last.index} (first tensor {last.entries[0].spec.name!r})" in str(error)
    assert "receiver bad's weights" in str(error) and "re-publish" in str(error)


def test_an_offer_passes_the_streams_bounds_and_an_oversized_key_is_refused():

    assert check_receiver_message(pb.ReceiverMessage(offer=pb.WriteOffer(key=b"k"))) == "offer"
    with pytest.raises(ConfigError, match="WriteOffer.key is 65 bytes"):
        check_receiver_message(pb.ReceiverMessage(offer=pb.WriteOffer(key=b"k" * 65)))


def test_an_offer_whose_piece_disagrees_in_rank_is_refused_naming_the_piece(caplog):
    piece = pb.SourcePiece(name="w", source=0, dtype="bfloat16", size=[2, 2], stride=[2])
    handle = pb.BufferHandle(buffer_id="b", nbytes=64, cuda_ipc=pb.CudaIpcHandle())
    offer = pb.WriteOffer(key=b"w1", sources=[handle], pieces=[piece])
    with caplog.at_level(logging.WARNING, "weightsync.sender"):
        assert map_offer(offer, "engine-0") is None
    assert "WriteOffer.pieces[0] (of 'w'): size [2, 2], stride [2]" in caplog.text


def _fused_case(kept: dict[str, tuple[tuple[int, ...], torch.Tensor]]):
    """A bucket of two tensors packed by the sender from the trainer's, and a receiver
    offering ``kept`` (by name: where its box starts, and its weights there)."""
    trainer = {
        "a": torch.randn(64, 32, generator=torch.Generator().manual_seed(1)),
        "b": torch.arange(48, dtype=torch.bfloat16),
    }
    (bucket,) = plan_buckets(
        tuple(TensorSpec.of(n, t) for n, t in trainer.items()), 1 << 20
    ).buckets
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pairs = [
        pair
        for entry in bucket.entries
        for pair in region_copies(
            buffer, entry, [Region((0,) * trainer[entry.name].dim(), trainer[entry.name])]
        )
    ]
    rows = plan_rows(
        spans_of(pairs), base=buffer.data_ptr(), nbytes=bucket.nbytes, destination=True
    )
    pack = SummedCopies(pairs, table(rows), buffer, bucket.nbytes)
    offered = Offered(
        {n: [Region(at, t)] for n, (at, t) in kept.items()}, torch.device("cpu"), None
    )
    slot = SimpleNamespace(buffer=SimpleNamespace(tensor=buffer), copies=SimpleNamespace(writes={}))
    return trainer, bucket, buffer, pack, offered, slot


def test_the_pack_writes_a_receivers_whole_tensors_in_its_own_launch():
    """``copy_sum_also`` run on the CPU over the table the sender builds: the bucket packed and
    the receiver's weights written from the trainer's bytes, summed once; worked out once per
    offer and pack."""
    live = {"a": torch.zeros(64, 32), "b": torch.zeros(48, dtype=torch.bfloat16)}
    trainer, bucket, buffer, pack, offered, slot = _fused_case(
        {n: ((0,) * t.dim(), t) for n, t in live.items()}
    )
    fused = _batch(slot, "r", offered, bucket, pack)
    assert isinstance(fused, SummedCopies) and fused.rows.shape[1] == 9
    assert _batch(slot, "r", offered, bucket, pack) is fused
    out = torch.zeros(2, dtype=torch.int64)
    cuda_on_cpu.launch(
        "copy_sum_also", fused.blocks, fused.rows.data_ptr(), fused.whole, out.data_ptr()
    )
    assert all(torch.equal(live[n], trainer[n]) for n in trainer)
    assert finish(out, bucket.nbytes) == finish(row_sums(buffer, bucket.nbytes), bucket.nbytes)


def test_a_receiver_keeping_a_shard_of_columns_is_written_from_the_slot_instead():
    # Its half of a's columns is strided in the bucket: not one run the pack can also write.
    shard = torch.zeros(64, 16)
    *_, bucket, _, pack, offered, slot = _fused_case(
        {"a": ((0, 16), shard), "b": ((0,), torch.zeros(48, dtype=torch.bfloat16))}
    )
    assert _batch(slot, "r", offered, bucket, pack) is None
    assert _batch(slot, "r", offered, bucket) is not None  # the copies from the slot


def test_a_write_that_fails_fails_only_its_receiver_naming_bucket_and_receiver(monkeypatch):
    """A write kernel that raises for one receiver (from the slot) fails that receiver, its
    weights counted as written; the other receiver is written (and counted), and the version
    goes on."""
    from weightsync.sender import writes as writes_module
    from weightsync.sender.states import OutcomeState

    class Copies:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def run(self):
            if self.fails:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return None

    failed = {}
    outcomes = {rid: SimpleNamespace(state=OutcomeState.PENDING, wrote=False) for rid in "ab"}

    def fail(rid, error):
        outcomes[rid].state = OutcomeState.FAILED
        failed[rid] = error

    version = SimpleNamespace(
        version=7, shared=SimpleNamespace(cond=threading.Condition()), outcomes=outcomes, fail=fail
    )
    cpu = torch.device("cpu")
    writes = Writes(granted={rid: Offered({}, cpu, None) for rid in "ab"})
    monkeypatch.setattr(writes_module, "pack_bucket", lambda *args: None)
    monkeypatch.setattr(
        writes_module, "_batch", lambda slot, rid, offered, bucket, pack=None: Copies(rid == "a")
    )
    bucket = SimpleNamespace(index=3, zero_gaps=lambda buffer: None)
    slot = SimpleNamespace(device="cpu", buffer=SimpleNamespace(tensor=None))
    sums, wrote = writes.pack(version, bucket, slot, True)
    assert sums is None and wrote == {"b"}
    assert writes.counts == {"b": 1}  # reported as its ReceiverOutcome.written_buckets
    assert list(failed) == ["a"] and outcomes["a"].wrote
    assert "version 7: writing bucket 3 into receiver a's weights failed" in str(failed["a"])
    assert "illegal memory access" in str(failed["a"])


def test_writes_from_the_slot_sum_its_padding_zeroed_when_the_pack_did_not_sum_it(monkeypatch):
    """A pack that cannot take the checksum (pieces from another GPU) leaves it to be taken
    apart, over the bucket with its padding zeroed; the writes from the slot sum the padding
    too, so it must be zeroed before they run, not after (an earlier bucket's bytes there
    failed the version on 2 x H200)."""
    from weightsync.sender import writes as writes_module
    from weightsync.sender.states import OutcomeState

    tensors = {"w": torch.zeros(8, 8, dtype=torch.float8_e4m3fn), "s": torch.zeros(3)}
    (bucket,) = plan_buckets(tuple(TensorSpec.of(n, t) for n, t in tensors.items()), 4096).buckets
    assert len(bucket.gaps), "the case needs padding"
    slot = SimpleNamespace(
        buffer=SimpleNamespace(tensor=torch.full((4096,), 0xEE, dtype=torch.uint8))
    )
    seen = []

    class Copies:
        def run(self):
            seen.append(slot.buffer.tensor[bucket.gaps].clone())

    outcomes = {"r": SimpleNamespace(state=OutcomeState.PENDING, wrote=False)}
    version = SimpleNamespace(shared=SimpleNamespace(cond=threading.Condition()), outcomes=outcomes)
    writes = Writes(granted={"r": Offered({}, torch.device("cpu"), None)})
    monkeypatch.setattr(writes_module, "pack_bucket", lambda *args: None)
    monkeypatch.setattr(writes_module, "_batch", lambda *args, **kwargs: Copies())
    slot.device = "cpu"
    sums, wrote = writes.pack(version, bucket, slot, True)
    assert sums is None and wrote == {"r"}
    (padding,) = seen
    assert not padding.any()
