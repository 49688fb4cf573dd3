import gc
import weakref

import pytest

from weightsync.memo import Memo, Same


class Computes:
    """``compute`` for a memo that records which keys were computed."""

    def __init__(self) -> None:
        self.keys: list[object] = []

    def __call__(self, key: object):
        def compute():
            self.keys.append(key)
            return [key]

        return compute


def test_a_hit_returns_the_kept_value_without_computing():
    memo: Memo[str, list] = Memo(2)
    computes = Computes()
    first = memo.get("a", computes("a"))
    assert memo.get("a", computes("a")) is first
    assert computes.keys == ["a"]


def test_the_least_recently_used_is_dropped_beyond_the_bound():
    memo: Memo[str, list] = Memo(2)
    computes = Computes()
    memo.get("a", computes("a"))
    memo.get("b", computes("b"))
    memo.get("a", computes("a"))  # a hit is a use: b is now the oldest
    memo.get("c", computes("c"))  # drops b, keeps a
    memo.get("a", computes("a"))
    memo.get("c", computes("c"))
    assert computes.keys == ["a", "b", "c"]
    memo.get("b", computes("b"))  # drops a
    memo.get("a", computes("a"))
    assert computes.keys == ["a", "b", "c", "b", "a"]


def test_a_dropped_value_is_no_longer_referenced():
    """What frees an offer's mapped memory: the memo holds nothing it dropped."""

    class Value:
        pass

    memo: Memo[str, Value] = Memo(1)
    dropped = weakref.ref(memo.get("a", Value))
    memo.get("b", Value)
    gc.collect()
    assert dropped() is None
    kept = weakref.ref(memo.get("c", Value))
    memo.clear()
    gc.collect()
    assert kept() is None


def test_none_is_kept_and_a_failed_compute_keeps_nothing():
    memo: Memo[str, None] = Memo(2)
    calls = []
    assert memo.get("a", lambda: calls.append("a")) is None
    assert memo.get("a", lambda: calls.append("a")) is None
    assert calls == ["a"]

    def fails():
        raise RuntimeError("no plan")

    with pytest.raises(RuntimeError):
        memo.get("b", fails)
    memo.get("b", lambda: calls.append("b"))  # computed now: the failure was not kept
    assert calls == ["a", "b"]


def test_same_matches_only_the_very_objects():
    boxes = {"w0": (0, 32)}
    memo: Memo[tuple[Same, str], list] = Memo(4)
    computes = Computes()
    first = memo.get((Same(boxes, None), "r0"), computes(1))
    assert memo.get((Same(boxes, None), "r0"), computes(2)) is first
    assert memo.get((Same(dict(boxes), None), "r0"), computes(3)) is not first  # equal, not it
    assert memo.get((Same(boxes), "r0"), computes(4)) is not first
    assert memo.get((Same(boxes, None), "r1"), computes(5)) is not first
    assert computes.keys == [1, 3, 4, 5]
    assert Same(boxes, None) == Same(boxes, None) != Same(dict(boxes), None)


def test_a_kept_key_keeps_its_objects_alive():
    """So no new object can take a kept one's id and be taken for it."""

    class Plan:
        pass

    memo: Memo[Same, int] = Memo(1)
    plan = Plan()
    alive = weakref.ref(plan)
    memo.get(Same(plan), lambda: 1)
    del plan
    gc.collect()
    assert alive() is not None
    memo.get(Same(Plan()), lambda: 2)
    gc.collect()
    assert alive() is None
