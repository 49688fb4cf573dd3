"""Joining a version's parts (receiver/parts.py): the union, and the exact error for each way
parts can disagree."""

from __future__ import annotations

import re

import pytest

from weightsync.buckets import TensorSpec
from weightsync.errors import PlanError
from weightsync.manifest import VersionManifest, VersionPartSpec, plan_digest
from weightsync.receiver.parts import ArrivedPart, check_part, join_parts, refuse_split

A, B = "unix:/tmp/a.sock", "unix:/tmp/b.sock"
SPECS = (
    (TensorSpec("w0", "float32", (4, 4)), TensorSpec("w1", "bfloat16", (8,))),
    (TensorSpec("w2", "int64", (3,)),),
)
DIGEST = plan_digest(SPECS)


def part(
    index: int,
    address: str | None = None,
    *,
    tensors: tuple[TensorSpec, ...] | None = None,
    count: int = 2,
    digest: str = DIGEST,
    num_tensors: int = 3,
    version: int = 7,
) -> ArrivedPart:
    spec = VersionPartSpec(index, count, f"trainer-{'ab'[index]}", digest, num_tensors)
    specs = SPECS[index] if tensors is None else tensors
    return ArrivedPart(address or (A, B)[index], VersionManifest(version, specs, part=spec))


def test_the_union_has_every_tensor_in_part_order_whatever_order_parts_came_in():
    union = join_parts([part(1), part(0)])
    assert union == VersionManifest(7, SPECS[0] + SPECS[1])
    assert union.part is None


def test_plan_digest_changes_with_the_assignment_of_tensors_to_parts():
    moved = ((SPECS[0][0],), (SPECS[0][1], SPECS[1][0]))
    assert plan_digest(SPECS) == plan_digest(SPECS)
    assert plan_digest(moved) != DIGEST
    assert plan_digest(tuple(reversed(SPECS))) != DIGEST


def test_mismatched_digest_names_both_parts():
    with pytest.raises(PlanError) as e:
        join_parts([part(0), part(1, digest="stale")])
    assert str(e.value) == (
        f"version 7: part 1 of 2 from sender trainer-b at {B} has plan_digest stale, but part "
        f"0 of 2 from sender trainer-a at {A} has {DIGEST}: the senders published different "
        "plans (a stale or foreign part); publish the version again from every sender"
    )


def test_a_tensor_in_two_parts_is_refused():
    with pytest.raises(PlanError) as e:
        join_parts([part(0), part(1, tensors=(SPECS[1][0], SPECS[0][1]))])
    assert str(e.value) == (
        f"version 7: tensor 'w1' is in part 0 of 2 from sender trainer-a at {A} and in part 1 "
        f"of 2 from sender trainer-b at {B}; each tensor belongs to exactly one part"
    )


def test_a_missing_part_is_named():
    with pytest.raises(PlanError) as e:
        join_parts([part(0), part(0, B)])
    assert str(e.value) == (
        f"version 7: part 0 of 2 from sender trainer-a at {A} and part 0 of 2 from sender "
        f"trainer-a at {B} are the same part; give each sender its own part index"
    )
    with pytest.raises(PlanError) as e:
        join_parts([part(1)])
    assert str(e.value) == (
        f"version 7: part 0 of 2 is missing (got part 1 of 2 from sender trainer-b at {B})"
    )


def test_a_wrong_count_is_refused_against_the_addresses_and_between_parts():
    three = part(0, count=3)
    with pytest.raises(PlanError) as e:
        check_part(three, [A, B])
    assert str(e.value) == (
        f"version 7 is split over 3 senders (this one: trainer-a at {A}) but this receiver is "
        f"registered with 2 ({A}, {B}); register the receiver with every sender's address"
    )
    with pytest.raises(PlanError, match=re.escape("announces 3 parts and 3 tensors, but")):
        join_parts([part(1), three])


def test_a_union_short_of_num_tensors_is_refused():
    with pytest.raises(PlanError) as e:
        join_parts([part(0, num_tensors=4), part(1, num_tensors=4)])
    assert str(e.value) == (
        "version 7: its 2 parts carry 3 tensors together but announce 4 (num_tensors)"
    )


def test_a_whole_version_is_refused_by_a_receiver_of_several_senders():
    whole = ArrivedPart(A, VersionManifest(7, SPECS[0]))
    with pytest.raises(PlanError, match=re.escape(f"version 7 came whole from the sender at {A}")):
        check_part(whole, [A, B])
    with pytest.raises(PlanError, match="either whole or split over every sender"):
        join_parts([part(0), whole])


def test_a_part_is_refused_by_a_receiver_of_one_sender():
    refuse_split(VersionManifest(7, SPECS[0]), A)  # a whole version: fine
    with pytest.raises(PlanError) as e:
        refuse_split(part(1).manifest, B)
    assert str(e.value) == (
        f"version 7 is split over 2 senders (this one: trainer-b at {B}); register the "
        "receiver with every sender's address"
    )
