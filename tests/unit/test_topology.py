"""The topology planner on described clusters: nearest copy, balance, slices, hosts, the floor."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.buckets import TensorSpec
from weightsync.errors import ConfigError, PlanError
from weightsync.topology import (
    Box,
    Link,
    LinkRates,
    Piece,
    Receiver,
    Source,
    TopologyPlan,
    merge_boxes,
    plan_topology,
    shard_box,
    whole_box,
)
from weightsync.topology_model import route_links

RATES = LinkRates()
# Four equal bf16 matrices (1 MiB each) and a scalar-free layout, so halves are exact.
MODEL = [TensorSpec(f"layers.{i}.w", "bfloat16", (512, 1024)) for i in range(4)]
TOTAL = sum(s.nbytes for s in MODEL)
# Mixed shapes and dtypes, a vector and a scalar included.
MIXED = [
    TensorSpec("embed", "bfloat16", (1000, 64)),
    TensorSpec("q", "bfloat16", (64, 64)),
    TensorSpec("norm", "float32", (64,)),
    TensorSpec("scale", "float32", ()),
]


def full_copy(rank: int, gpu: str, host: str = "h0", model=MODEL) -> Source:
    return Source(rank, gpu, host, tuple(Piece(s.name, whole_box(s.shape)) for s in model))


def shard(rank: int, gpu: str, dim: int, tp: int, world: int, host="h0", model=MODEL) -> Source:
    """A trainer TP rank holding its shard of every tensor along ``dim``."""
    return Source(
        rank,
        gpu,
        host,
        tuple(Piece(s.name, shard_box(s.shape, dim, tp, world)) for s in model),
    )


def engine_rank(rid: str, gpu: str, dim: int, tp: int, world: int, host="h0") -> Receiver:
    needs = tuple(Piece(s.name, shard_box(s.shape, dim, tp, world)) for s in MODEL)
    return Receiver(rid, gpu, host, needs)


def check(plan: TopologyPlan, manifest, sources, receivers) -> None:
    """What every plan guarantees: each receiver's needs covered exactly once, each transfer
    from a source holding all of it by its nearest route, bytes adding up, floor <= predicted."""
    specs = {s.name: s for s in manifest}
    by_rank = {s.rank: s for s in sources}
    for r in receivers:
        needs = r.needs or tuple(Piece(s.name, whole_box(s.shape)) for s in manifest)
        mine = [t for t in plan.transfers if t.receiver == r.id]
        for need in needs:
            got = [t.box for t in mine if t.tensor == need.tensor]
            inside = [b for b in got if need.box.intersect(b) is not None]
            assert all(need.box.contains(b) for b in inside)
            assert sum(b.numel for b in inside) == need.box.numel
            for i, a in enumerate(inside):
                assert all(a.intersect(b) is None for b in inside[i + 1 :])
        for t in mine:
            src = by_rank[t.source]
            assert any(p.tensor == t.tensor and p.box.contains(t.box) for p in src.pieces)
            itemsize = specs[t.tensor].nbytes // math.prod(specs[t.tensor].shape)
            assert t.nbytes == t.box.numel * itemsize
            # Nearest: nothing closer holds any of this box.
            closer = {
                "local": [],
                "peer": [s for s in sources if s.gpu == r.gpu],
                "remote": [s for s in sources if s.host == r.host],
            }[t.route]
            assert not any(
                p.tensor == t.tensor and p.box.intersect(t.box) for s in closer for p in s.pieces
            )
            assert t.route == ("local" if src.gpu == r.gpu else "peer" if src.host == r.host
                               else "remote")  # fmt: skip
    assert sum(plan.route_bytes.values()) == sum(t.nbytes for t in plan.transfers)
    # Link bytes are the transfers' bytes on the links of their routes; time is the busiest.
    links: dict[Link, int] = defaultdict(int)
    at = {r.id: (r.gpu, r.host) for r in receivers}
    for t in plan.transfers:
        src = by_rank[t.source]
        for link in route_links(t.route, (src.gpu, src.host), at[t.receiver]):
            links[link] += t.nbytes
    assert plan.link_bytes == links
    seconds = [n / plan.rates.rate(link.kind) for link, n in plan.link_bytes.items()]
    assert plan.predicted_s == max(seconds, default=0)
    assert plan.receiver_bytes == {
        r.id: sum(t.nbytes for t in plan.transfers if t.receiver == r.id)
        for r in sorted(receivers, key=lambda r: r.id)
    }
    assert plan.floor_s <= plan.predicted_s * (1 + 1e-9)


def plan_and_check(manifest, sources, receivers, rates=RATES, **kw) -> TopologyPlan:
    plan = plan_topology(manifest, sources, receivers, rates, **kw)
    check(plan, manifest, sources, receivers)
    return plan


def test_a_receiver_on_the_gpu_of_a_full_copy_reads_locally():
    sources = [full_copy(0, "g0"), full_copy(1, "g1")]
    plan = plan_and_check(MIXED, [full_copy(0, "g0", model=MIXED)], [Receiver("r", "g0", "h0")])
    assert {t.route for t in plan.transfers} == {"local"}
    plan = plan_and_check(MODEL, sources, [Receiver("r", "g1", "h0")])
    assert {(t.route, t.source) for t in plan.transfers} == {("local", 1)}
    assert plan.route_bytes == {"local": TOTAL, "peer": 0, "remote": 0}
    assert plan.link_bytes == {Link("hbm", "g1"): TOTAL}
    assert plan.predicted_s == pytest.approx(TOTAL / RATES.hbm)
    assert plan.bottleneck == Link("hbm", "g1")


def test_dp4_with_a_receiver_per_gpu_costs_one_gpu_copying_its_own_memory():
    sources = [full_copy(rank, f"g{rank}") for rank in range(4)]
    receivers = [Receiver(f"e{i}", f"g{i}", "h0") for i in range(4)]
    plan = plan_and_check(MODEL, sources, receivers)
    assert all(t.route == "local" and t.receiver == f"e{t.source}" for t in plan.transfers)
    assert plan.route_bytes["local"] == 4 * TOTAL
    assert plan.predicted_s == pytest.approx(TOTAL / RATES.hbm)
    assert plan.floor_s == pytest.approx(plan.predicted_s)


def test_one_source_gpu_and_four_receivers_is_bound_by_that_gpus_outbound_link():
    # The measured wall today: every engine reads the one staged copy over NVLink.
    receivers = [Receiver(f"e{i}", f"g{i}", "h0") for i in range(1, 5)]
    plan = plan_and_check(MODEL, [full_copy(0, "g0")], receivers)
    assert {(t.route, t.source) for t in plan.transfers} == {("peer", 0)}
    assert plan.link_bytes[Link("nvlink_out", "g0")] == 4 * TOTAL
    peer_read = TOTAL / RATES.nvlink_out
    assert plan.predicted_s == pytest.approx(4 * peer_read)
    assert plan.bottleneck == Link("nvlink_out", "g0")
    assert plan.floor_s == pytest.approx(4 * peer_read) and "nvlink_out of [g0]" in plan.floor_bound
    # An engine on the source's GPU reads locally, so only three reads leave it.
    receivers = [Receiver(f"e{i}", f"g{i}", "h0") for i in range(4)]
    plan = plan_and_check(MODEL, [full_copy(0, "g0")], receivers)
    assert plan.route_bytes == {"local": TOTAL, "peer": 3 * TOTAL, "remote": 0}
    assert plan.predicted_s == pytest.approx(3 * peer_read)


def test_tp2_shards_on_two_gpus_each_supply_half_of_a_whole_tensor():
    sources = [shard(0, "g0", 0, 0, 2), shard(1, "g1", 0, 1, 2)]
    plan = plan_and_check(MODEL, sources, [Receiver("r", "g2", "h0")])
    assert len(plan.transfers) == 2 * len(MODEL)
    for t in plan.transfers:
        assert t.box == shard_box((512, 1024), 0, t.source, 2)
    assert plan.source_bytes == {0: TOTAL // 2, 1: TOTAL // 2}
    # The receiver's inbound link carries everything, so it bounds the plan.
    assert plan.bottleneck == Link("nvlink_in", "g2")
    assert plan.predicted_s == pytest.approx(TOTAL / RATES.nvlink_in)


def test_engine_tp2_ranks_take_only_their_half():
    sources = [full_copy(0, "g0"), full_copy(1, "g1")]
    receivers = [engine_rank("e0", "g0", 0, 0, 2), engine_rank("e1", "g1", 0, 1, 2)]
    plan = plan_and_check(MODEL, sources, receivers)
    assert plan.receiver_bytes == {"e0": TOTAL // 2, "e1": TOTAL // 2}
    assert plan.route_bytes == {"local": TOTAL, "peer": 0, "remote": 0}
    assert plan.predicted_s == pytest.approx(TOTAL / 2 / RATES.hbm)


def test_trainer_column_shards_into_engine_row_shards_read_a_quarter_local_a_quarter_peer():
    sources = [shard(0, "g0", 0, 0, 2), shard(1, "g1", 0, 1, 2)]
    receivers = [engine_rank("e0", "g0", 1, 0, 2), engine_rank("e1", "g1", 1, 1, 2)]
    plan = plan_and_check(MODEL, sources, receivers)
    assert plan.route_bytes == {"local": TOTAL // 2, "peer": TOTAL // 2, "remote": 0}
    e0 = {(t.box, t.source, t.route) for t in plan.transfers if t.tensor == "layers.0.w"
          and t.receiver == "e0"}  # fmt: skip
    assert e0 == {
        (Box((0, 0), (256, 512)), 0, "local"),
        (Box((256, 0), (256, 512)), 1, "peer"),
    }


def test_equally_near_replicas_share_the_receivers_each_reading_from_one():
    sources = [full_copy(0, "g0"), full_copy(1, "g1")]
    plan = plan_and_check(MODEL, sources, [Receiver("r", "g2", "h0")])
    assert plan.source_bytes == {0: TOTAL, 1: 0}
    # Four receivers elsewhere: each replica serves two, twice as fast as one source alone.
    receivers = [Receiver(f"e{i}", f"g{i}", "h0") for i in range(2, 6)]
    plan = plan_and_check(MODEL, sources, receivers)
    assert plan.source_bytes == {0: 2 * TOTAL, 1: 2 * TOTAL}
    assert {len({t.source for t in plan.transfers if t.receiver == r.id}) for r in receivers} == {1}
    assert plan.predicted_s == pytest.approx(2 * TOTAL / RATES.nvlink_out)
    assert plan.floor_s == pytest.approx(plan.predicted_s)


def test_trainer_tp2_dp2_into_four_engines_pairs_the_gpus():
    # Ranks 0, 1 are one TP=2 replica on g0, g1; ranks 2, 3 the other on g2, g3. Each engine
    # keeps its own GPU's half and reads the other half from one peer, and each GPU serves one
    # peer: pairs, the copy engines' fastest pattern, not each GPU reading from two peers.
    sources = [shard(r, f"g{r}", 0, r % 2, 2) for r in range(4)]
    receivers = [Receiver(f"e{i}", f"g{i}", "h0") for i in range(4)]
    plan = plan_and_check(MODEL, sources, receivers)
    peers = {
        r.id: {t.source for t in plan.transfers if t.receiver == r.id and t.route == "peer"}
        for r in receivers
    }
    assert peers == {"e0": {1}, "e1": {0}, "e2": {3}, "e3": {2}}
    assert plan.route_bytes == {"local": 2 * TOTAL, "peer": 2 * TOTAL, "remote": 0}
    assert plan.predicted_s == pytest.approx(TOTAL / 2 / RATES.nvlink_in)


def test_one_large_tensor_is_split_in_rows_over_equally_near_remote_replicas():
    big = [TensorSpec("embed", "bfloat16", (1001, 64))]
    sources = [full_copy(0, "a0", "A", model=big), full_copy(1, "a1", "A", model=big)]
    receivers = [Receiver("r", "b0", "B")]
    whole = plan_and_check(big, sources, receivers)  # below the default split size
    assert [(t.box, t.source) for t in whole.transfers] == [(whole_box((1001, 64)), 0)]
    split = plan_and_check(big, sources, receivers, split_min_bytes=1)
    assert [(t.box, t.source) for t in split.transfers] == [
        (Box((0, 0), (500, 64)), 1),
        (Box((500, 0), (501, 64)), 0),  # the larger part goes first, to the first GPU
    ]
    assert split.link_bytes[Link("nic_out", "a0")] < whole.link_bytes[Link("nic_out", "a0")]
    # Within a host a receiver reads one set of copies from one of them: no split.
    peer = [full_copy(0, "g0", model=big), full_copy(1, "g1", model=big)]
    one = plan_and_check(big, peer, [Receiver("r", "g2", "h0")], split_min_bytes=1)
    assert [(t.box, t.source) for t in one.transfers] == [(whole_box((1001, 64)), 0)]


def test_a_receiver_on_another_host_reads_remotely_and_is_bound_by_the_nic():
    sources = [full_copy(0, "a0", "A")]
    plan = plan_and_check(MODEL, sources, [Receiver("r", "b0", "B")])
    assert {(t.route, t.source) for t in plan.transfers} == {("remote", 0)}
    assert plan.link_bytes[Link("nic_out", "a0")] == TOTAL
    assert plan.link_bytes[Link("host_in", "B")] == TOTAL
    assert plan.bottleneck is not None and plan.bottleneck.kind in ("nic_in", "nic_out")
    assert plan.predicted_s == pytest.approx(TOTAL / RATES.nic_in)
    # A copy on the receiver's own host wins over the other host's.
    plan = plan_and_check(MODEL, [*sources, full_copy(1, "b1", "B")], [Receiver("r", "b0", "B")])
    assert {(t.route, t.source) for t in plan.transfers} == {("peer", 1)}


def test_remote_bytes_spread_over_the_sending_hosts_nics_and_respect_a_host_limit():
    sources = [full_copy(0, "a0", "A"), full_copy(1, "a1", "A")]
    receivers = [engine_rank("e0", "b0", 0, 0, 2, "B"), engine_rank("e1", "b1", 0, 1, 2, "B")]
    plan = plan_and_check(MODEL, sources, receivers)
    assert plan.link_bytes[Link("nic_out", "a0")] == plan.link_bytes[Link("nic_out", "a1")]
    assert plan.predicted_s == pytest.approx(TOTAL / 2 / RATES.nic_out)
    assert plan.floor_s == pytest.approx(plan.predicted_s)
    # Host B's NICs together at 6e10: two GPUs pulling at 5e10 each are bound by the host.
    rates = LinkRates(host_in=6e10)
    plan = plan_and_check(MODEL, sources, receivers, rates)
    assert plan.bottleneck == Link("host_in", "B")
    assert plan.predicted_s == pytest.approx(TOTAL / 6e10)
    assert plan.floor_s == pytest.approx(plan.predicted_s)


def test_bytes_no_source_holds_raise_naming_the_tensor_and_the_box():
    half = Source(0, "g0", "h0", (Piece("embed", Box((0, 0), (500, 64))),))
    with pytest.raises(PlanError, match=r"'embed': box \[500:1000, 0:64\].*receiver 'r'"):
        plan_topology(MIXED[:1], [half], [Receiver("r", "g1", "h0")])
    with pytest.raises(PlanError, match=r"'q': box \[0:64, 0:64\].*none of it"):
        embed_only = Source(0, "g0", "h0", (Piece("embed", whole_box((1000, 64))),))
        plan_topology(MIXED[:2], [embed_only], [Receiver("r", "g1", "h0")])


def test_bad_inputs_are_refused_with_what_is_wrong():
    src = full_copy(0, "g0", model=MIXED)
    with pytest.raises(PlanError, match="'nope'"):
        plan_topology(MIXED, [src], [Receiver("r", "g0", "h0", (Piece("nope", Box((), ())),))])
    with pytest.raises(PlanError, match="outside its shape"):
        plan_topology(
            MIXED, [src], [Receiver("r", "g0", "h0", (Piece("q", Box((0, 0), (65, 1))),))]
        )
    overlap = (Piece("q", Box((0, 0), (10, 64))), Piece("q", Box((5, 0), (10, 64))))
    with pytest.raises(PlanError, match="overlapping"):
        plan_topology(MIXED, [src], [Receiver("r", "g0", "h0", overlap)])
    with pytest.raises(PlanError, match="'g0'.*hosts"):
        plan_topology(MIXED, [src], [Receiver("r", "g0", "h1")])
    with pytest.raises(PlanError, match="appears twice"):
        plan_topology(MIXED, [src, src], [Receiver("r", "g0", "h0")])


def _cluster():
    """Two trainer hosts (TP=2 x DP=2 each: column shards), engines TP=2 on both hosts and
    one more host, a whole-model receiver too."""
    sources = [
        shard(rank, f"{host}{rank % 4}", 0, rank % 2, 2, host, MIXED[:3])
        for host, ranks in (("A", range(0, 4)), ("B", range(4, 8)))
        for rank in ranks
    ]
    receivers = [
        Receiver(f"{host}e{i}", f"{host}{i}", host,
                 tuple(Piece(s.name, shard_box(s.shape, 1 if len(s.shape) > 1 else 0, i, 2))
                       for s in MIXED[:3]))
        for host in ("A", "B", "C") for i in range(2)
    ] + [Receiver("whole", "C3", "C")]  # fmt: skip
    return sources, receivers


def test_same_input_gives_the_same_plan_in_any_order():
    sources, receivers = _cluster()
    first = plan_and_check(MIXED[:3], sources, receivers)
    shuffled = [Source(s.rank, s.gpu, s.host, s.pieces[::-1]) for s in sources[::-1]]
    again = plan_topology(MIXED[:3], shuffled, receivers[::-1])
    assert again == first
    assert {t.route for t in first.transfers} == {"local", "peer", "remote"}
    keys = [(t.receiver, t.tensor, t.box) for t in first.transfers]
    assert len(keys) == len(set(keys))


def test_shard_box_and_merge_boxes():
    assert shard_box((10, 4), 0, 1, 4) == Box((3, 0), (3, 4))
    assert shard_box((10, 4), 0, 3, 4) == Box((9, 0), (1, 4))  # ceil shards, last clipped
    assert shard_box((8, 6), 1, 1, 2) == Box((0, 3), (8, 3))  # row-parallel: split the input dim
    with pytest.raises(ConfigError):
        shard_box((8, 6), 2, 0, 2)
    with pytest.raises(ConfigError):
        shard_box((8, 6), 0, 2, 2)
    quads = [(Box((r, c), (2, 3)), "k") for r in (0, 2) for c in (0, 3)]
    assert merge_boxes(quads) == [(Box((0, 0), (4, 6)), "k")]
    assert merge_boxes([(Box((0,), (2,)), "a"), (Box((2,), (2,)), "b")]) == [
        (Box((0,), (2,)), "a"),
        (Box((2,), (2,)), "b"),
    ]


@st.composite
def clusters(draw):
    """Random 2-D tensors, random trainer shards (one full copy guarantees coverage) on GPUs of
    two hosts, random engine shards."""
    shapes = draw(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=3))
    manifest = [TensorSpec(f"t{i}", "bfloat16", shape) for i, shape in enumerate(shapes)]
    gpus = [(f"{h}{g}", h) for h in "AB" for g in range(3)]
    sources = [full_copy(0, *draw(st.sampled_from(gpus)), model=manifest)]
    for rank in range(1, draw(st.integers(1, 5))):
        world = draw(st.integers(1, 3))
        dim = draw(st.integers(0, 1))
        tp = draw(st.integers(0, world - 1))
        gpu, host = draw(st.sampled_from(gpus))
        sources.append(shard(rank, gpu, dim, tp, world, host, manifest))
    receivers = []
    for i in range(draw(st.integers(1, 4))):
        gpu, host = draw(st.sampled_from(gpus))
        world, dim = draw(st.integers(1, 3)), draw(st.integers(0, 1))
        needs = tuple(Piece(s.name, shard_box(s.shape, dim, i % world, world)) for s in manifest)
        receivers.append(Receiver(f"r{i}", gpu, host, needs if world > 1 else ()))
    return manifest, sources, receivers, draw(st.sampled_from([1, 10**9]))


@settings(max_examples=150, deadline=None)
@given(clusters())
def test_any_cluster_is_covered_exactly_from_nearest_copies(cluster):
    manifest, sources, receivers, split = cluster
    plan_and_check(manifest, sources, receivers, split_min_bytes=split)
