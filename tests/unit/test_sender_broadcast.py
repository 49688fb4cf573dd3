"""Errors about a broadcast group say which group and whose it is."""

from types import SimpleNamespace

from weightsync.sender.broadcast import group_name


def test_a_group_is_named_by_what_it_carries_and_its_receivers():
    run = SimpleNamespace(
        slices=(SimpleNamespace(members=("r0", "r2")), SimpleNamespace(members=("r1", "r3")))
    )
    assert group_name(run, ("r1", "r3")) == "slice group 1 (receivers r1, r3)"
    assert group_name(run, ("r4",)) == "the staged buckets' group (receivers r4)"
