"""The per-token staleness bookkeeping (weightsync.staleness): run lists, one request's tracker
fed step by step, and the RL-side helpers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.errors import VersionError
from weightsync.staleness import (
    EpochTracker,
    behaviour_versions,
    expand_runs,
    oldest_version,
    policy_epoch_from_spans,
    stale_choices,
    version_of_label,
)


def test_one_version_is_one_run():
    tracker = EpochTracker(prompt_len=4)
    for _ in range(5):
        tracker.step(version=3, num_new_tokens=1)
    report = tracker.report()
    assert report.policy_epoch == [(0, 3)]
    assert report.kv_cache_epoch == [(0, 3)]
    assert report.num_evictions == 0
    # Prompt (4) plus every token but the last has KV.
    assert len(expand_runs(report.kv_cache_epoch, 4 + 5 - 1)) == 8


def test_switch_keeps_old_kv_until_recomputed():
    tracker = EpochTracker(prompt_len=4)
    for _ in range(3):  # tokens 0..2 under v1; KV of positions 0..5 (prompt + tokens 0, 1)
        tracker.step(1, 1)
    tracker.step(2, 1)  # token 3 under v2; it computed position 6 (token 2)
    tracker.step(2, 1)  # token 4; position 7
    report = tracker.report()
    assert report.policy_epoch == [(0, 1), (3, 2)]
    assert report.kv_cache_epoch == [(0, 1), (6, 2)]
    # An eviction reported with the next token: everything recomputed under v2.
    tracker.step(2, 1, num_evictions=1)
    report = tracker.report()
    assert report.kv_cache_epoch == [(0, 2)]
    assert report.policy_epoch == [(0, 1), (3, 2)]
    assert report.num_evictions == 1
    assert behaviour_versions(report.policy_epoch, 6) == [1, 1, 1, 2, 2, 2]


def test_eviction_reported_without_tokens_then_recompute_under_a_later_version():
    tracker = EpochTracker(prompt_len=2)
    tracker.step(1, 1)
    tracker.step(1, 1)
    tracker.step(1, 0, num_evictions=1)  # e.g. an output carrying only the event
    tracker.step(3, 1)
    tracker.step(3, 1)
    report = tracker.report()
    assert report.policy_epoch == [(0, 1), (2, 3)]
    assert report.kv_cache_epoch == [(0, 3)]
    assert report.num_evictions == 1


def test_several_tokens_per_step_and_trimmed_tokens():
    tracker = EpochTracker(prompt_len=3)
    tracker.step(1, 1)  # KV 0..2
    tracker.step(1, 3)  # spec decode: three tokens; KV 3..5
    tracker.step(2, 2)  # KV 6..7
    assert tracker.report().kv_cache_epoch == [(0, 1), (6, 2)]
    assert tracker.report().policy_epoch == [(0, 1), (4, 2)]
    # A stop string matched in token 3: the output keeps four tokens.
    trimmed = tracker.report(num_tokens=4)
    assert trimmed.policy_epoch == [(0, 1)]
    assert trimmed.kv_cache_epoch == [(0, 1)]
    assert expand_runs(trimmed.kv_cache_epoch, 3 + 4 - 1) == [1] * 6


def test_without_engine_events_kv_and_evictions_are_unknown():
    tracker = EpochTracker(prompt_len=2, events_reported=False)
    tracker.step(0, 1)
    report = tracker.report()
    assert report.as_dict() == {
        "policy_epoch": [[0, 0]],
        "kv_cache_epoch": None,
        "num_evictions": None,
    }


def test_no_tokens_reports_empty_runs():
    report = EpochTracker(prompt_len=5).report()
    assert report.policy_epoch == [] and report.kv_cache_epoch == []


def test_version_labels():
    assert version_of_label("default") == 0
    assert version_of_label("12") == 12
    with pytest.raises(VersionError, match="'v3'.*weight_version=str"):
        version_of_label("v3")


def test_expand_runs_checks_its_input():
    assert expand_runs([[0, 1], [2, 4]], 5) == [1, 1, 4, 4, 4]
    assert expand_runs([(0, 1), (2, 4)], 1) == [1]
    assert expand_runs([], 0) == []
    with pytest.raises(ValueError, match="start at index 0"):
        expand_runs([(1, 1)], 3)
    with pytest.raises(ValueError, match="increase"):
        expand_runs([(0, 1), (2, 2), (2, 3)], 4)


def test_stale_choices_and_oldest_version():
    choices = [("a", [(0, 5), (3, 7)]), ("b", [(0, 7)]), ("c", [])]
    assert oldest_version(choices[0][1]) == 5 and oldest_version([]) is None
    (stale,) = stale_choices(choices, current_version=8, max_lag=2)
    assert (stale.key, stale.oldest_version, stale.lag) == ("a", 5, 3)
    assert stale_choices(choices, current_version=8, max_lag=3) == []
    with pytest.raises(ValueError, match="max_lag"):
        stale_choices(choices, 8, -1)


def test_staleness_bound():
    tracker = EpochTracker(prompt_len=2, max_policy_lag=1)
    assert not tracker.over_bound(9)  # nothing sampled yet: nothing is stale
    tracker.step(3, 2)
    tracker.step(4, 1)
    assert not tracker.over_bound(4)
    assert tracker.over_bound(5)
    assert not EpochTracker(prompt_len=2).over_bound(100)


def test_policy_epoch_from_engine_spans():
    # SGLang's meta_info["weight_versions"] (sglang.srt.utils.weight_versions), labels set by
    # weightsync.drivers.sglang as str(version); "default" is the server's initial label.
    sglang = [
        {"version": "default", "start": 0, "end": 3},
        {"version": "4", "start": 3, "end": 3},  # an empty span (no token under it) is skipped
        {"version": "5", "start": 3, "end": 9},
    ]
    assert policy_epoch_from_spans(sglang) == [(0, 0), (3, 5)]

    class Span:  # vLLM's WeightVersionSpan
        def __init__(self, version, start, end):
            self.version, self.start, self.end = version, start, end

    assert policy_epoch_from_spans([Span("2", 0, 4), Span("2", 4, 6)]) == [(0, 2)]
    assert policy_epoch_from_spans([]) == []
    with pytest.raises(ValueError, match="contiguous"):
        policy_epoch_from_spans([Span("1", 0, 2), Span("2", 3, 4)])
    with pytest.raises(VersionError, match="'rl-step-3'"):
        policy_epoch_from_spans([Span("rl-step-3", 0, 2)])


steps = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 1)), min_size=1, max_size=30
)


@given(prompt_len=st.integers(1, 6), steps=steps)
def test_runs_match_a_per_position_model(prompt_len, steps):
    """The run lists equal a naive per-position record of the same steps."""
    tracker = EpochTracker(prompt_len)
    policy: list[int] = []
    kv: list[int] = []
    evicted = True
    for bump, num_new, evictions in steps:
        version = (policy[-1] if policy else 0) + bump  # versions only grow
        tracker.step(version, num_new, evictions)
        evicted = evicted or evictions > 0
        if num_new == 0:
            continue
        end = prompt_len + len(policy) + num_new - 1
        kv = kv[: 0 if evicted else len(kv)] + [version] * (end - (0 if evicted else len(kv)))
        evicted = False
        policy += [version] * num_new
    report = tracker.report()
    assert expand_runs(report.policy_epoch, len(policy)) == policy
    assert expand_runs(report.kv_cache_epoch, len(kv)) == kv
    assert all(
        a[1] != b[1] for a, b in zip(report.kv_cache_epoch, report.kv_cache_epoch[1:], strict=False)
    )
    assert report.num_evictions == sum(e for _, _, e in steps)
