"""The sender's planner: a pure function of (manifest, offers, receivers, settings)."""

from __future__ import annotations

import pytest

from weightsync.buckets import TensorSpec
from weightsync.config import SenderSettings
from weightsync.manifest import VersionManifest
from weightsync.sender.planner import (
    BROADCAST,
    MAP,
    Staging,
    TensorPlans,
    plan_tensors,
    plan_version,
)
from weightsync.sender.records import ReceiverConn
from weightsync.v1 import weightsync_pb2 as pb

GPU0, GPU1 = "GPU-0000", "GPU-1111"
MANIFEST = VersionManifest(1, tuple(TensorSpec(f"w{i}", "float32", (64,)) for i in range(4)))
"""Four 256-byte tensors."""


def piece(name: str, offset: int, size: int, start: int = 0, dtype: str = "float32"):
    return pb.SourcePiece(
        name=name, source=0, offset=offset, dtype=dtype, size=[size], stride=[1], dst_start=[start]
    )


def offer(*pieces: pb.SourcePiece, allow_direct: bool = True) -> dict[int, pb.BeginVersion]:
    """One rank offering ``pieces`` of one 4 KiB storage."""
    source = pb.BufferHandle(buffer_id="storage", nbytes=4096)
    return {0: pb.BeginVersion(sources=[source], pieces=pieces, allow_direct=allow_direct)}


WHOLE_W1_W3 = offer(
    piece("w1", 0, 64),
    piece("w3", 256, 64),
    piece("w0", 512, 32),
    piece("w0", 768, 32, start=32),  # w0 in two pieces: staged; w2 not offered at all
)
EVERY_TENSOR = offer(
    piece("w0", 0, 32),
    piece("w0", 256, 32, start=32),
    piece("w1", 512, 64),
    piece("w2", 768, 64),
    piece("w3", 1024, 64),
)


def receiver(rid: str, *, remote: bool = False, gpu: str = GPU1, connected: bool = True):
    conn = ReceiverConn(rid, "torch", 0, "cuda:0", (), remote=remote, device_uuid=gpu)
    conn.connected = connected
    return conn


def plan(offers, receivers, transport: str = "cuda_ipc", setting: str = "auto"):
    settings = SenderSettings(bucket_size_bytes=1024, transport=setting)
    return plan_version(MANIFEST, offers, receivers, settings, Staging(transport, GPU0))


def names(buckets) -> list[str]:
    return [e.name for b in buckets for e in b.entries]


def test_receivers_on_another_host_get_broadcasts():
    paths = plan(EVERY_TENSOR, [receiver("here"), receiver("there", remote=True)]).data_paths
    assert paths == {"here": MAP, "there": BROADCAST}


def test_nccl_broadcasts_to_every_receiver_but_the_one_on_the_staging_gpu():
    receivers = [receiver("same-gpu", gpu=GPU0), receiver("other-gpu", gpu=GPU1)]
    paths = plan(EVERY_TENSOR, receivers, setting="nccl").data_paths
    assert paths == {"same-gpu": MAP, "other-gpu": BROADCAST}


def test_whole_contiguous_tensors_go_direct_and_the_rest_is_staged():
    p = plan(WHOLE_W1_W3, [receiver("local")])
    assert names([p.tensors.direct]) == ["w1", "w3"]
    assert [e.offset for e in p.tensors.direct.entries] == [0, 256]
    assert p.tensors.direct.index == len(p.tensors.staged.buckets)
    assert names(p.tensors.staged.buckets) == ["w0", "w2"]
    assert len(p.tensors.layouts) == len(p.tensors.staged.buckets) + 1


NOT_ALLOWED = offer(*WHOLE_W1_W3[0].pieces, allow_direct=False)


@pytest.mark.parametrize(
    "offers, receivers, transport",
    [
        (WHOLE_W1_W3, [receiver("a"), receiver("b", remote=True)], "cuda_ipc"),
        (WHOLE_W1_W3, [receiver("a")], "shm"),
        (NOT_ALLOWED, [receiver("a")], "cuda_ipc"),
    ],
    ids=["a receiver gets broadcasts", "staging is not cuda_ipc", "no publisher allows it"],
)
def test_nothing_goes_direct_unless_allowed_over_cuda_ipc_and_every_receiver_maps(
    offers, receivers, transport
):
    p = plan(offers, receivers, transport=transport)
    assert p.tensors.direct is None
    assert names(p.tensors.staged.buckets) == ["w0", "w1", "w2", "w3"]


def test_a_disconnected_receiver_does_not_prevent_direct_reads():
    p = plan(WHOLE_W1_W3, [receiver("a"), receiver("gone", remote=True, connected=False)])
    assert names([p.tensors.direct]) == ["w1", "w3"]


def test_the_sender_packs_only_when_the_offer_covers_every_staged_tensor():
    assert not plan(WHOLE_W1_W3, [receiver("a", remote=True)]).tensors.sender_packs  # w2 missing
    assert plan(EVERY_TENSOR, [receiver("a", remote=True)]).tensors.sender_packs
    beyond = offer(*EVERY_TENSOR[0].pieces[:-1], piece("w3", 1024, 64, start=8))
    assert not plan(beyond, [receiver("a", remote=True)]).tensors.sender_packs


def test_every_tensor_direct_leaves_no_staged_bucket():
    every_whole = offer(*(piece(f"w{i}", 256 * i, 64) for i in range(4)))
    p = plan(every_whole, [receiver("a")])
    assert p.tensors.staged.buckets == ()
    assert p.tensors.direct.index == 0 and p.tensors.direct.is_last
    assert names([p.tensors.direct]) == ["w0", "w1", "w2", "w3"]
    assert len(p.tensors.layouts) == 1 and not p.tensors.sender_packs


def test_the_memo_plans_a_layout_once_per_direct_choice():
    memo = TensorPlans(max_entries=2).memo(b"manifest", (b"offer",))
    first = memo(MANIFEST, WHOLE_W1_W3, True, 1024)
    assert memo(MANIFEST, WHOLE_W1_W3, True, 1024) is first
    staged = memo(MANIFEST, WHOLE_W1_W3, False, 1024)
    assert staged is not first and staged.direct is None
    assert staged == plan_tensors(MANIFEST, WHOLE_W1_W3, False, 1024)
