"""The version a new one must exceed (``VersionHistory``): the largest that counts, found from
the newest run back (issue 32: it was a scan of every kept run on each version's path)."""

import threading
from dataclasses import dataclass, field

import pytest

from weightsync.errors import VersionError
from weightsync.sender.history import VersionHistory
from weightsync.sender.records import Outcome
from weightsync.sender.states import OutcomeState, VersionState


@dataclass
class Run:
    """What the history reads of a version."""

    version: int
    state: VersionState = VersionState.READING
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    gc_hold: None = None


def _applied(version: int) -> Run:
    return Run(version, VersionState.COMPLETE, {"r": Outcome(OutcomeState.APPLIED)})


def _rejected(version: int) -> Run:
    """Every receiver refused its manifest: it left no trace."""
    return Run(version, VersionState.FAILED, {"r": Outcome(OutcomeState.FAILED)})


COND = threading.Condition(threading.RLock())
"""The sender's one lock, which every history method runs under."""


def _history(*runs: Run, keep: int = 64) -> VersionHistory:
    history = VersionHistory(COND, keep)
    for run in runs:
        _add(history, run)
    return history


def _add(history: VersionHistory, run: Run) -> None:
    with COND:
        history.check_version(run.version)
        history.add_run(run)


def test_a_version_that_left_no_trace_does_not_hold_the_next_back():
    history = _history(_applied(5), _rejected(1000))
    assert history.last_version == 5
    _add(history, _applied(6))  # 1000's number was never used
    assert history.last_version == 6


def test_a_newer_run_that_leaves_no_trace_later_uncovers_the_one_before():
    history = _history(_applied(5), in_flight := Run(7))
    assert history.last_version == 7  # in flight: it counts
    in_flight.state, in_flight.outcomes = VersionState.FAILED, {"r": Outcome(OutcomeState.FAILED)}
    assert history.last_version == 5
    with pytest.raises(VersionError, match="not greater than the last published version 5"):
        history.check_version(5)


def test_dropped_runs_still_count_and_an_empty_history_starts_at_zero():
    assert _history().last_version == 0
    history = _history(_applied(1), _applied(2), _rejected(3), _rejected(4), keep=2)
    assert history.last_version == 2  # 1 and 2 were dropped; 2 had been applied
