"""The collector's pause: nested holds, released on another thread, the prior state kept."""

from __future__ import annotations

import gc
import threading

import pytest

from weightsync import gc_pause


@pytest.fixture(autouse=True)
def _collector_on():
    gc.enable()
    yield
    gc.enable()


def test_the_collector_is_off_while_any_hold_is_held_and_on_after_the_last():
    outer = gc_pause.Hold()
    with gc_pause.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the outer hold still pauses it
    released = threading.Thread(target=outer.release)  # a version ends on another thread
    released.start()
    released.join()
    assert gc.isenabled()


def test_releasing_twice_releases_once():
    first, second = gc_pause.Hold(), gc_pause.Hold()
    first.release()
    first.release()
    assert not gc.isenabled()
    second.release()
    assert gc.isenabled()


def test_a_process_that_turned_the_collector_off_keeps_it_off():
    gc.disable()
    with gc_pause.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_version_lets_go_when_it_ends_or_leaves_the_history():
    """The sender holds a pause per version: released when the version ends (here: its every
    receiver failed), or, one that never ended, when the history drops it."""
    from tests.support.sender_parts import SETTINGS, new_run, sender_parts
    from weightsync.wire import error_to_pb

    parts = sender_parts()
    ended, forgotten = new_run(parts, 1), new_run(parts, 2)
    for run in (ended, forgotten):
        run.gc_hold = gc_pause.Hold()
        with parts.cond:
            parts.history.add_run(run)
    with parts.cond:
        ended.abort(error_to_pb(RuntimeError("gone")))
    assert not gc.isenabled()  # version 2 is still in flight
    for version in range(3, 3 + SETTINGS.history):
        with parts.cond:
            parts.history.add_run(new_run(parts, version))
    assert gc.isenabled()
