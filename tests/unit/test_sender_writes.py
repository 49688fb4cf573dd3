"""The sender's side of writing a receiver's weights (protocol §4.3), without a GPU: which
offers it takes, and how a written bucket that differs from the packed one is reported. The
writes themselves run on a GPU: tests/gpu/test_sender_writes.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from weightsync.buckets import TensorSpec, plan_buckets
from weightsync.checksum import finish_all, row_sums
from weightsync.errors import ConfigError
from weightsync.limits import check_receiver_message
from weightsync.sender.writes import Writes, map_offer
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
