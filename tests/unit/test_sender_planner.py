"""The sender's planner: a pure function of (manifest, offers, receivers, settings)."""

from __future__ import annotations

import math
import random

import pytest

from weightsync.buckets import TensorSpec
from weightsync.config import SenderSettings
from weightsync.errors import PlanError
from weightsync.manifest import VersionManifest
from weightsync.sender.direct_reads import DirectReads, plan_direct_reads
from weightsync.sender.planner import (
    BROADCAST,
    MAP,
    Staging,
    TensorPlans,
    plan_tensors,
    plan_version,
)
from weightsync.sender.records import ReceiverConn
from weightsync.topology_model import Box
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
    piece("w0", 768, 32, start=32),  # w0 in two pieces that tile it; w2 not offered at all
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


def test_whole_contiguous_tensors_and_pieces_that_tile_one_go_direct_and_the_rest_is_staged():
    p = plan(WHOLE_W1_W3, [receiver("local")])
    direct = p.tensors.direct
    assert names([direct]) == ["w0", "w0", "w1", "w3"]
    assert [(e.offset, e.box_start, e.spec.shape) for e in direct.entries] == [
        (512, (0,), (32,)),
        (768, (32,), (32,)),
        (0, (), (64,)),
        (256, (), (64,)),
    ]
    assert direct.nbytes == 3 * 256
    assert direct.index == len(p.tensors.staged.buckets)
    assert names(p.tensors.staged.buckets) == ["w2"]
    assert len(p.tensors.layouts) == len(p.tensors.staged.buckets) + 1


@pytest.mark.parametrize(
    "pieces",
    [
        [piece("w0", 0, 32), piece("w0", 512, 16, start=48)],
        [piece("w0", 0, 40), piece("w0", 512, 32, start=32)],
        [piece("w0", 0, 32), piece("w0", 512, 32, start=32, dtype="bfloat16")],
        [
            piece("w0", 0, 32),
            pb.SourcePiece(
                name="w0", offset=512, dtype="float32", size=[32], stride=[2], dst_start=[32]
            ),
        ],
    ],
    ids=["a gap", "overlapping", "another dtype", "strided"],
)
def test_pieces_that_do_not_tile_a_tensor_in_its_own_dtype_are_staged(pieces):
    every_other = [piece(f"w{i}", 1024 + 256 * i, 64) for i in (1, 2, 3)]
    p = plan(offer(*pieces, *every_other), [receiver("local")])
    assert names([p.tensors.direct]) == ["w1", "w2", "w3"]
    assert names(p.tensors.staged.buckets) == ["w0"]


NOT_ALLOWED = offer(*WHOLE_W1_W3[0].pieces, allow_direct=False)
STILL_BEING_WRITTEN = {0: pb.BeginVersion(ready=[b"event"])}
STILL_BEING_WRITTEN[0].MergeFrom(WHOLE_W1_W3[0])


@pytest.mark.parametrize(
    "offers, receivers, transport",
    [
        (WHOLE_W1_W3, [receiver("a"), receiver("b", remote=True)], "cuda_ipc"),
        (WHOLE_W1_W3, [receiver("a")], "shm"),
        (NOT_ALLOWED, [receiver("a")], "cuda_ipc"),
        (STILL_BEING_WRITTEN, [receiver("a")], "cuda_ipc"),
    ],
    ids=[
        "a receiver gets broadcasts",
        "staging is not cuda_ipc",
        "no publisher allows it",
        "pieces still being written (ready events)",
    ],
)
def test_nothing_goes_direct_unless_allowed_over_cuda_ipc_and_every_receiver_maps(
    offers, receivers, transport
):
    p = plan(offers, receivers, transport=transport)
    assert p.tensors.direct is None
    assert names(p.tensors.staged.buckets) == ["w0", "w1", "w2", "w3"]


def test_a_disconnected_receiver_does_not_prevent_direct_reads():
    p = plan(WHOLE_W1_W3, [receiver("a"), receiver("gone", remote=True, connected=False)])
    assert names([p.tensors.direct]) == ["w0", "w0", "w1", "w3"]


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


# --- several ranks offering the same tensors (DP replicas): nearest copy per receiver --------


def replicas(n: int) -> tuple[dict[int, pb.BeginVersion], dict[int, str]]:
    """``n`` ranks, each on its own GPU ``GPU-r`` with all four tensors whole in its storage."""
    begins = {
        r: pb.BeginVersion(
            sources=[pb.BufferHandle(buffer_id=f"storage-{r}", nbytes=4096)],
            pieces=[piece(f"w{i}", 256 * i, 64) for i in range(4)],
            allow_direct=True,
        )
        for r in range(n)
    }
    return begins, {r: f"GPU-{r}" for r in range(n)}


SETTINGS_1K = SenderSettings(bucket_size_bytes=1024)


def plan_dp(n_replicas: int, receiver_gpus: list[str]):
    begins, gpus = replicas(n_replicas)
    receivers = [receiver(f"r{i}", gpu=g) for i, g in enumerate(receiver_gpus)]
    staging = Staging("cuda_ipc", gpus[0])
    return plan_version(MANIFEST, begins, receivers, SETTINGS_1K, staging, gpus=gpus)


def read_ranks(read) -> list[int]:
    """The rank whose storage each entry of a receiver's direct bucket reads."""
    return [int(read.sources[e.source].buffer_id.split("-")[1]) for e in read.layout.entries]


def test_each_receiver_on_a_replicas_gpu_reads_only_its_own_gpus_copy():
    p = plan_dp(4, ["GPU-0", "GPU-1", "GPU-2", "GPU-3"])
    for i in range(4):
        read = p.direct_reads[f"r{i}"]
        assert [s.buffer_id for s in read.sources] == [f"storage-{i}"]
        assert read_ranks(read) == [i] * 4
        assert [e.tensor.name for e in read.layout.entries] == ["w0", "w1", "w2", "w3"]
        assert [e.offset for e in read.layout.entries] == [0, 256, 512, 768]
        assert read.layout.index == p.tensors.direct.index
    assert p.route_bytes == {"local": 4 * 1024, "peer": 0, "staged": 0, "broadcast": 0}


def test_receivers_beyond_the_replicas_gpus_read_from_peers_balanced():
    p = plan_dp(2, ["GPU-0", "GPU-1", "GPU-2", "GPU-3"])
    assert read_ranks(p.direct_reads["r0"]) == [0] * 4
    assert read_ranks(p.direct_reads["r1"]) == [1] * 4
    peer = read_ranks(p.direct_reads["r2"]) + read_ranks(p.direct_reads["r3"])
    assert sorted(peer) == [0] * 4 + [1] * 4  # each replica's GPU sends half the peer bytes
    assert p.route_bytes == {"local": 2 * 1024, "peer": 2 * 1024, "staged": 0, "broadcast": 0}


def test_receivers_on_no_replicas_gpu_are_balanced_over_the_replicas():
    p = plan_dp(2, ["GPU-7", "GPU-8", "", ""])
    ranks = [r for i in range(4) for r in read_ranks(p.direct_reads[f"r{i}"])]
    assert sorted(ranks) == [0] * 8 + [1] * 8
    assert p.route_bytes["peer"] == 4 * 1024 and p.route_bytes["local"] == 0


def test_a_single_source_gives_every_receiver_the_bucket_of_today():
    p = plan(offer(*(piece(f"w{i}", 256 * i, 64) for i in range(4))), [receiver("a")])
    read = p.direct_reads["a"]
    assert read.layout == p.tensors.layouts[p.tensors.direct.index]
    assert read.sources == p.tensors.direct_sources
    assert read.route_bytes == {"local": 0, "peer": 1024}


def test_replicas_are_packed_once_from_the_staging_gpus_copy():
    begins, gpus = replicas(2)
    for rank in range(2):
        receivers = [receiver("far", remote=True)]
        staging = Staging("cuda_ipc", gpus[rank])
        p = plan_version(MANIFEST, begins, receivers, SETTINGS_1K, staging, gpus=gpus)
        assert p.tensors.direct is None and p.tensors.sender_packs
        assert list(p.tensors.pack_from) == [rank]
        assert [x.name for x in p.tensors.pack_from[rank].pieces] == ["w0", "w1", "w2", "w3"]
        assert p.route_bytes == {"local": 0, "peer": 0, "staged": 0, "broadcast": 1024}
    # Without GPUs (shm): the lowest rank's copy.
    cpu = plan_version(MANIFEST, begins, [receiver("a")], SETTINGS_1K, Staging("shm"))
    assert cpu.tensors.sender_packs and list(cpu.tensors.pack_from) == [0]
    assert cpu.route_bytes["staged"] == 1024


def test_direct_reads_are_planned_once_per_tensor_plan_and_receivers():
    begins, gpus = replicas(2)
    tensors = plan_tensors(MANIFEST, begins, True, 1024, gpus, "GPU-0")
    memo = DirectReads(max_entries=2)
    at = (("r0", "GPU-0"), ("r1", "GPU-1"))
    first = memo(tensors, at)
    assert memo(tensors, at) is first
    assert memo(tensors, (("r0", "GPU-1"),)) is not first
    assert first == plan_direct_reads(tensors, at)
    # Each read's layout key names its layout and sources: equal when planned again, distinct
    # for another copy (a receiver keeps layouts by key).
    assert len(first["r0"].key) == 16 and first["r0"].key != first["r1"].key


def test_tp_shards_of_dp_replicas_are_packed_once_each():
    """TP=2 x DP=2: ranks 0 and 2 hold the first half of every tensor, 1 and 3 the second."""
    begins = {
        r: pb.BeginVersion(
            sources=[pb.BufferHandle(buffer_id=f"storage-{r}", nbytes=4096)],
            pieces=[piece(f"w{i}", 128 * i, 32, start=32 * (r % 2)) for i in range(4)],
        )
        for r in range(4)
    }
    gpus = {r: f"GPU-{r}" for r in range(4)}
    tensors = plan_tensors(MANIFEST, begins, False, 1024, gpus, "GPU-0")
    assert tensors.sender_packs and list(tensors.pack_from) == [0, 1]
    assert all(len(b.pieces) == 4 for b in tensors.pack_from.values())


def tp_dp(tp: int, dp: int) -> tuple[dict[int, pb.BeginVersion], dict[int, str]]:
    """TP=``tp`` x DP=``dp`` ranks, rank ``r`` on ``GPU-r`` holding TP shard ``r % tp`` (dim 0)
    of every tensor, allowed to be read in place."""
    n = 64 // tp
    begins = {
        r: pb.BeginVersion(
            sources=[pb.BufferHandle(buffer_id=f"storage-{r}", nbytes=4096)],
            pieces=[piece(f"w{i}", 4 * n * i, n, start=n * (r % tp)) for i in range(4)],
            allow_direct=True,
        )
        for r in range(tp * dp)
    }
    return begins, {r: f"GPU-{r}" for r in range(tp * dp)}


def read_pieces(read) -> list[tuple[str, int, list[int]]]:
    """Each entry of a receiver's direct bucket: (tensor, rank read from, box start)."""
    return [
        (e.tensor.name, int(read.sources[e.source].buffer_id.split("-")[1]), list(e.box_start))
        for e in read.layout.entries
    ]


def plan_tp(tp: int, dp: int, receivers):
    begins, gpus = tp_dp(tp, dp)
    staging = Staging("cuda_ipc", gpus[0])
    return plan_version(MANIFEST, begins, receivers, SETTINGS_1K, staging, gpus=gpus)


def test_a_whole_engine_reads_every_tp_shard_in_place_from_its_nearest_copy():
    """TP=2 x DP=2 trainer; engine ranks on GPUs 0 and 3 keep every tensor whole: each reads its
    own GPU's shard locally and the other shard from a peer GPU, nothing staged."""
    p = plan_tp(2, 2, [receiver("r0", gpu="GPU-0"), receiver("r3", gpu="GPU-3")])
    assert p.tensors.staged.buckets == () and len(p.tensors.direct.entries) == 8
    for rid, own, others in (("r0", 0, {1, 3}), ("r3", 3, {0, 2})):
        read = read_pieces(p.direct_reads[rid])
        assert [(n, s) for n, _, s in read] == [(f"w{i}", [s]) for i in range(4) for s in (0, 32)]
        assert {rank for _, rank, (s,) in read if s == 32 * (own % 2)} == {own}  # its GPU's shard
        assert {rank for _, rank, (s,) in read if s != 32 * (own % 2)} <= others  # a replica's
    assert p.route_bytes == {"local": 1024, "peer": 1024, "staged": 0, "broadcast": 0}


def test_an_engine_tp_rank_reads_only_the_shards_holding_its_own():
    """TP=2 trainer, TP=2 engine: engine rank 1 (on GPU 0) keeps the second half of w0 and w1
    and all of w2, w3 (replicated): it reads only trainer rank 1's half of w0 and w1."""
    engine = [receiver("e0", gpu="GPU-0"), receiver("e1", gpu="GPU-0")]
    second = {"w0": Box((32,), (32,)), "w1": Box((32,), (32,))}
    engine[1].declare(second, MANIFEST.tensors)
    p = plan_tp(2, 1, engine)
    assert read_pieces(p.direct_reads["e1"]) == [
        ("w0", 1, [32]), ("w1", 1, [32]), ("w2", 0, [0]), ("w2", 1, [32]), ("w3", 0, [0]),
        ("w3", 1, [32]),
    ]  # fmt: skip
    assert p.direct_reads["e1"].route_bytes == {"local": 2 * 128, "peer": 4 * 128}
    assert p.direct_reads["e0"].route_bytes == {"local": 512, "peer": 512}


def test_a_receiver_that_declared_its_shard_is_planned_for_its_shard():
    """An engine TP rank's verdict declared half of w0 and w1: its route bytes count those
    halves; its entries stay whole tensors (its loaders narrow them as they copy)."""
    begins, gpus = replicas(2)
    receivers = [receiver("r0", gpu="GPU-0"), receiver("r1", gpu="GPU-1")]
    halves = {"w0": Box((32,), (32,)), "w1": Box((0,), (32,))}
    receivers[1].declare(halves, MANIFEST.tensors)
    assert receivers[1].kept_bytes == 1024 - 2 * 128
    memo = DirectReads()
    p = plan_version(
        MANIFEST, begins, receivers, SETTINGS_1K, Staging("cuda_ipc", gpus[0]), gpus=gpus,
        reads_of=memo,
    )  # fmt: skip
    assert p.direct_reads["r1"].route_bytes == {"local": 1024 - 2 * 128, "peer": 0}
    assert p.direct_reads["r0"].route_bytes == {"local": 1024, "peer": 0}
    assert [e.tensor.name for e in p.direct_reads["r1"].layout.entries] == ["w0", "w1", "w2", "w3"]
    # Declared again unchanged, its record keeps the same boxes: the memo's plan is reused;
    # declared otherwise, it is planned again.
    tensors = plan_tensors(MANIFEST, begins, True, 1024, gpus, "GPU-0")
    at = (("r0", "GPU-0"), ("r1", "GPU-1"))
    first = memo(tensors, at, {"r1": receivers[1].keeps})
    receivers[1].declare(dict(halves), MANIFEST.tensors)
    assert memo(tensors, at, {"r1": receivers[1].keeps}) is first
    receivers[1].declare({"w0": halves["w0"]}, MANIFEST.tensors)
    assert receivers[1].kept_bytes == 1024 - 128
    assert memo(tensors, at, {"r1": receivers[1].keeps})["r1"].route_bytes["local"] == 1024 - 128


def test_remote_receivers_keeping_the_same_boxes_share_a_slice_group():
    """Two replicas' TP rank 0 keep w0[0:32], rank 1 w0[32:64]; a TP=1 engine keeps all. Each
    TP rank's group gets buckets of its boxes (numbered after the staged ones'), the TP=1
    engine and the local receiver the staged buckets."""
    first, second = {"w0": Box((0,), (32,))}, {"w0": Box((32,), (32,))}
    far = [receiver(rid, remote=True) for rid in ("a0", "b0", "a1", "b1", "whole")]
    for conn, boxes in zip(far, (first, first, second, second, {}), strict=False):
        conn.declare(boxes, MANIFEST.tensors)
    p = plan(EVERY_TENSOR, [*far, receiver("near")])
    assert [g.members for g in p.slices] == [("a0", "b0"), ("a1", "b1")]
    staged = len(p.tensors.layouts)
    for i, (group, start) in enumerate(zip(p.slices, (0, 32), strict=True)):
        assert [b.index for b in group.plan.buckets] == [staged + i]
        (w0, *rest) = group.plan.buckets[0].entries
        assert (w0.name, w0.box_start, w0.spec.shape) == ("w0", (start,), (32,))
        assert [e.name for e in rest] == ["w1", "w2", "w3"] and not any(e.box_start for e in rest)
        assert group.layouts[0].entries[0].box_start == [start]
    assert p.route_bytes["broadcast"] == 4 * (1024 - 128) + 1024
    assert p.route_bytes["staged"] == 1024
    # Boxes are sent only where the sender packs: a publisher packs whole buckets.
    assert plan(WHOLE_W1_W3, far).slices == ()


GRID = VersionManifest(
    1,
    (
        TensorSpec("col", "bfloat16", (8, 6)),  # split along dim 0 (column-parallel)
        TensorSpec("row", "bfloat16", (6, 8)),  # split along dim 1 (row-parallel)
        TensorSpec("norm", "bfloat16", (6,)),  # replicated
        TensorSpec("empty", "bfloat16", (0, 4)),
    ),
)


def _random_layout(rng):
    """A random trainer (TP x DP ranks on random GPUs, some sharing one, some on none; a
    tensor sharded by every rank, by none, or by some; some ranks hold their shard in two
    pieces), receivers on random GPUs (some on none or on a GPU no rank is on), random
    declared boxes (TP shards, or any range)."""
    tp, dp = rng.choice([1, 2, 2]), rng.choice([1, 2, 3])
    gpus = [rng.choice(["GPU-a", "GPU-b", "GPU-c", ""]) for _ in range(tp * dp)]
    sharded = {spec.name: rng.choice([1.0, 1.0, 0.0, 0.7]) for spec in GRID.tensors}
    begins = {}
    for r in range(tp * dp):
        t, offset, pieces = r % tp, 0, []
        for spec in GRID.tensors:
            dim = 1 if spec.name == "row" else 0
            shard = tp > 1 and spec.name != "norm" and rng.random() < sharded[spec.name]
            start = [0] * len(spec.shape)
            size = list(spec.shape)
            if shard and spec.shape[dim]:
                size[dim] = spec.shape[dim] // tp
                start[dim] = size[dim] * t
            stride = [size[1], 1] if len(size) == 2 else [1]
            # Some ranks hold their rows of `col` as two pieces (cells of equal holders).
            rows = size[0] // 2 if spec.name == "col" and rng.random() < 0.3 else size[0]
            for first, n in ((0, rows), (rows, size[0] - rows)):
                if n == 0 and first:
                    continue
                pieces.append(
                    pb.SourcePiece(
                        name=spec.name,
                        source=0,
                        offset=offset,
                        dtype="bfloat16",
                        size=[n, *size[1:]],
                        stride=stride,
                        dst_start=[start[0] + first, *start[1:]],
                    )  # fmt: skip
                )
                offset += 2 * max(1, n * math.prod(size[1:]))
        begins[r] = pb.BeginVersion(
            sources=[pb.BufferHandle(buffer_id=f"storage-{r}", nbytes=4096)],
            pieces=pieces,
            allow_direct=True,
        )
    receivers = tuple(
        sorted((f"r{i}", rng.choice(["GPU-a", "GPU-b", "GPU-e", ""])) for i in range(4))
    )
    keeps = {}
    for rid, _ in receivers:
        choice = rng.random()
        if choice < 0.4:
            continue  # keeps everything whole
        boxes = {}
        for spec in GRID.tensors[:2]:
            dim = 1 if spec.name == "row" else 0
            half, start, size = spec.shape[dim] // 2, [0, 0], list(spec.shape)
            if choice < 0.8:  # an engine TP=2 rank's shard
                size[dim], start[dim] = half, half * rng.choice([0, 1])
            else:  # any box
                a, b = sorted(rng.sample(range(spec.shape[dim] + 1), 2))
                start[dim], size[dim] = a, b - a
            boxes[spec.name] = Box(tuple(start), tuple(size))
        keeps[rid] = boxes
    return begins, dict(enumerate(gpus)), receivers, keeps


@pytest.mark.parametrize("seed", range(100))
def test_reads_found_on_the_receivers_own_gpu_are_what_the_planner_chooses(seed):
    """The shortcut (a tensor whose needed box lies in one offered box held on the receiver's
    GPU is read there without the planner) gives the very reads the planner gives alone."""
    rng = random.Random(seed)
    begins, gpus, receivers, keeps = _random_layout(rng)
    tensors = plan_tensors(GRID, begins, True, 1024, gpus, gpus[0])
    if tensors.direct is None:
        pytest.skip("nothing direct in this layout")
    fast = plan_direct_reads(tensors, receivers, keeps)
    planned = plan_direct_reads(tensors, receivers, keeps, shortcut=False)
    assert fast.keys() == planned.keys() == {rid for rid, _ in receivers}
    for rid, read in planned.items():
        assert fast[rid].layout == read.layout, rid
        assert (fast[rid].sources, dict(fast[rid].route_bytes), fast[rid].key) == (
            read.sources, dict(read.route_bytes), read.key
        ), rid  # fmt: skip


def test_a_declared_box_outside_its_tensor_is_refused_naming_it_not_read_locally():
    begins, gpus = replicas(2)
    tensors = plan_tensors(MANIFEST, begins, True, 1024, gpus, "GPU-0")
    keeps = {"r0": {"w1": Box((32,), (48,))}}  # w1 has 64 elements
    with pytest.raises(PlanError, match=r"receiver 'r0'.*'w1' is outside its shape \(64,\)"):
        plan_direct_reads(tensors, (("r0", "GPU-0"),), keeps)
