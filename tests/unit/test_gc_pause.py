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
