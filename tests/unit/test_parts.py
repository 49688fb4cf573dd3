"""weightsync/parts.py: each HF tensor to one trainer host's sender, bytes balanced, one digest."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.buckets import TensorSpec
from weightsync.errors import PlanError
from weightsync.manifest import VersionPartSpec, plan_digest
from weightsync.parts import plan_parts


def spec(name: str, numel: int, dtype: str = "float32") -> TensorSpec:
    return TensorSpec(name, dtype, (numel,))


def test_each_tensor_goes_to_its_only_holder_and_parts_keep_manifest_order():
    manifest = [spec("embed", 100), spec("l0", 10), spec("l1", 10), spec("head", 100)]
    copies = {"embed": [{"a"}], "l0": [{"a"}], "l1": [{"b"}], "head": [{"b"}]}
    plan = plan_parts(manifest, copies)
    assert plan.hosts == ("a", "b")
    assert [s.name for s in plan.tensors_of("a")] == ["embed", "l0"]
    assert [s.name for s in plan.tensors_of("b")] == ["l1", "head"]
    assert plan.part_of("a") == VersionPartSpec(0, 2, "a", plan.plan_digest, 4)
    assert plan.part_of("b") == VersionPartSpec(1, 2, "b", plan.plan_digest, 4)
    assert plan.bytes_of("a") == plan.bytes_of("b") == 440


def test_tensors_held_by_several_hosts_balance_bytes_largest_first():
    # Greedy largest-first onto the least loaded: 8 -> a, 7 -> b, 6 -> b, 5 -> a, 4 -> a|b.
    sizes = {"t8": 8, "t7": 7, "t6": 6, "t5": 5, "t4": 4}
    manifest = [spec(n, s) for n, s in sizes.items()]
    plan = plan_parts(manifest, {n: [{"a"}, {"b"}] for n in sizes})
    assert dict(plan.owner) == {"t8": "a", "t7": "b", "t6": "b", "t5": "a", "t4": "a"}
    assert (plan.bytes_of("a"), plan.bytes_of("b")) == (4 * 17, 4 * 13)


def test_a_host_that_sends_nothing_has_no_part_and_one_sender_means_no_part():
    manifest = [spec("w", 4), spec("v", 4)]
    plan = plan_parts(manifest, {"w": [{"a"}], "v": [{"a"}]})
    assert plan.hosts == ("a",)
    assert plan.part_of("a") is None
    assert plan.tensors_of("a") == tuple(manifest)
    assert plan.tensors_of("b") == () and plan.part_of("b") is None


def test_part_index_is_the_sorted_position_of_the_host_id():
    manifest = [spec("x", 4), spec("y", 4), spec("z", 4)]
    plan = plan_parts(manifest, {"x": [{"zz"}], "y": [{"aa"}], "z": [{"mm"}]})
    assert plan.hosts == ("aa", "mm", "zz")
    assert [plan.part_of(h).index for h in ("aa", "mm", "zz")] == [0, 1, 2]


def test_a_tensor_split_over_hosts_is_refused_naming_tensor_and_hosts():
    manifest = [spec("norm", 4), spec("q_proj", 64)]
    with pytest.raises(PlanError) as err:
        plan_parts(manifest, {"norm": [{"a"}], "q_proj": [{"trainer-b", "trainer-a"}]})
    assert "'q_proj'" in str(err.value)
    assert "hosts trainer-a, trainer-b" in str(err.value)
    assert "TP groups must stay within a host" in str(err.value)


def test_a_spread_copy_is_fine_when_another_copy_is_within_one_host():
    plan = plan_parts([spec("w", 4)], {"w": [{"a", "b"}, {"c"}]})
    assert dict(plan.owner) == {"w": "c"}


def test_a_tensor_nobody_holds_is_refused():
    with pytest.raises(PlanError, match="'w' is held by no trainer host"):
        plan_parts([spec("w", 4)], {})


def test_duplicate_names_are_refused():
    with pytest.raises(PlanError, match="'w' is listed twice"):
        plan_parts([spec("w", 4), spec("w", 4)], {"w": [{"a"}]})


def test_digest_is_the_manifest_digest_of_the_parts_and_changes_with_any_field():
    manifest = [spec("b", 4), TensorSpec("a", "bfloat16", (2, 3))]
    plan = plan_parts(manifest, {"a": [{"h0"}], "b": [{"h1"}]})
    want = plan_digest([(manifest[1],), (manifest[0],)])
    assert plan.plan_digest == want
    moved = plan_parts(manifest, {"a": [{"h1"}], "b": [{"h0"}]})
    assert moved.plan_digest != want
    retyped = plan_parts([spec("b", 4), spec("a", 6)], {"a": [{"h0"}], "b": [{"h1"}]})
    assert retyped.plan_digest != want


@given(
    st.lists(st.integers(1, 1000), min_size=1, max_size=40),
    st.lists(st.sets(st.sampled_from("abcd"), min_size=1), min_size=1, max_size=40),
)
def test_every_tensor_is_sent_once_by_a_holder_and_the_plan_is_order_independent(
    sizes, holder_sets
):
    manifest = [spec(f"t{i}", n) for i, n in enumerate(sizes)]
    holders = {s.name: holder_sets[i % len(holder_sets)] for i, s in enumerate(manifest)}
    copies = {n: [{h} for h in hs] for n, hs in holders.items()}
    plan = plan_parts(manifest, copies)
    sent = [s.name for h in plan.hosts for s in plan.tensors_of(h)]
    assert sorted(sent) == sorted(s.name for s in manifest)
    assert all(plan.owner[n] in holders[n] for n in holders)
    assert all(plan.tensors_of(h) for h in plan.hosts)
    # Every rank sees the copies in its own order: the plan must not depend on it.
    shuffled = {n: list(reversed(c)) for n, c in reversed(list(copies.items()))}
    assert plan_parts(manifest, shuffled) == plan
    assert plan.plan_digest == plan_digest([plan.tensors_of(h) for h in plan.hosts])
    # Greedy bound: no host carries more than the fair share plus its largest tensor.
    if all(len(hs) == 4 for hs in holders.values()):
        total = sum(s.nbytes for s in manifest)
        biggest = max(s.nbytes for s in manifest)
        assert max(plan.bytes_of(h) for h in plan.hosts) <= total / 4 + biggest


# --- Megatron: which replica of which host sends each tensor (plan_hosts) -------------------


def dp_plans(tp: int, dp: int) -> list:
    """Synthetic Llama ranks (tests.unit.test_megatron_plan), TP fastest, planned with every
    replica."""
    from tests.unit.test_megatron_plan import config, dense_rank
    from weightsync.sender.megatron import RankTopology, plan_rank

    return [
        plan_rank(
            dense_rank(tp),
            RankTopology(tp_rank=r % tp, tp_size=tp, dp_rank=r // tp, dp_size=dp),
            config(),
            every_replica=True,
        )
        for r in range(tp * dp)
    ]


def test_data_parallel_replicas_on_two_hosts_split_the_bytes():
    from weightsync.sender.megatron import check_coverage
    from weightsync.sender.megatron.coverage import plan_hosts

    plans = dp_plans(tp=2, dp=2)
    hosts = ["a", "a", "b", "b"]
    narrowed, parts = plan_hosts(plans, hosts)
    assert parts.hosts == ("a", "b")
    biggest = max(s.nbytes for s in plans[0].manifest)
    assert abs(parts.bytes_of("a") - parts.bytes_of("b")) <= biggest
    check_coverage(narrowed)  # every byte written exactly once, by the chosen replicas
    for plan, host in zip(narrowed, hosts, strict=True):
        assert set(plan.pieces) <= {s.name for s in parts.tensors_of(host)}
    # Replica 1 (host b) writes what host b sends, itself included the TP-replicated norms.
    norm = next(n for n, h in parts.owner.items() if h == "b" and "norm" in n)
    assert norm in narrowed[2].pieces and norm not in narrowed[3].pieces


def test_one_host_plans_exactly_replica_0_as_before():
    from tests.unit.test_megatron_plan import config, dense_rank
    from weightsync.sender.megatron import RankTopology, plan_rank
    from weightsync.sender.megatron.coverage import plan_hosts

    narrowed, parts = plan_hosts(dp_plans(tp=2, dp=2), ["h"] * 4)
    assert parts.part_of("h") is None and len(parts.tensors_of("h")) == parts.num_tensors
    for r, plan in enumerate(narrowed):
        topo = RankTopology(tp_rank=r % 2, tp_size=2, dp_rank=r // 2, dp_size=2)
        assert dict(plan.pieces) == dict(plan_rank(dense_rank(2), topo, config()).pieces)


def test_a_replica_spanning_hosts_is_skipped_for_one_within_a_host():
    from weightsync.sender.megatron.coverage import plan_hosts

    _, parts = plan_hosts(dp_plans(tp=2, dp=2), ["a", "b", "c", "c"])
    # Replica 0's TP pair spans a and b: every TP-split tensor comes from replica 1 on c; the
    # norms (written by TP rank 0 alone) are whole on a too.
    assert "b" not in parts.hosts
    assert {h for n, h in parts.owner.items() if "norm" not in n} == {"c"}


def test_a_tp_group_spanning_hosts_is_refused_naming_tensor_and_hosts():
    from weightsync.sender.megatron.coverage import plan_hosts

    with pytest.raises(PlanError) as err:
        plan_hosts(dp_plans(tp=2, dp=1), ["trainer-a", "trainer-b"])
    message = str(err.value)
    assert "HF tensor 'model.embed_tokens.weight'" in message
    assert (
        "hosts trainer-a, trainer-b" in message and "TP groups must stay within a host" in message
    )
