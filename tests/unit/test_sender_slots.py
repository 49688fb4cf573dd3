"""The sender's staging slots: allocation, reuse only after every reader, read events."""

from __future__ import annotations

import os

import pytest
import torch

from weightsync.sender.slots import ReadEvent, SlotPool
from weightsync.transports import get_transport

CPU = torch.device("cpu")
SHM = get_transport("shm")


@pytest.fixture
def pool():
    """Two slots of shm staging (bucket cap 4 MiB); read events "open" as ``opened:<handle>``."""
    slots = SlotPool(2, 4 << 20, open_event=lambda handle, device: f"opened:{handle.decode()}")
    slots.reallocate(256, CPU, SHM)
    yield slots
    slots.close()


def test_slots_are_allocated_once_and_again_when_a_bucket_outgrows_them():
    slots = SlotPool(2, 4 << 20)
    assert not slots.fits(256, CPU)
    slots.reallocate(256, CPU, SHM)
    try:
        assert len(slots.slots) == 2
        # Rounded up to 1 MiB so small growth does not reallocate every version.
        assert [s.buffer.nbytes for s in slots.slots] == [1 << 20, 1 << 20]
        assert slots.fits(1 << 20, CPU)
        assert not slots.fits(256, torch.device("cuda", 0))
        assert not slots.fits((1 << 20) + 256, CPU)
        old = [s.buffer.handle.shm.path for s in slots.slots]
        slots.reallocate(2 << 20, CPU, SHM)
        assert [s.buffer.nbytes for s in slots.slots] == [2 << 20, 2 << 20]
        assert not any(os.path.exists(p) for p in old)  # the old buffers were released
    finally:
        slots.close()
    assert slots.slots == ()


def test_a_slot_is_capped_at_the_bucket_size_unless_a_bucket_needs_more():
    slots = SlotPool(2, 1024)
    slots.reallocate(256, CPU, SHM)
    try:
        assert [s.buffer.nbytes for s in slots.slots] == [1024, 1024]
    finally:
        slots.close()


def test_a_slot_is_reused_only_after_every_reader_released_it(pool):
    first, second = pool.claim(0), pool.claim(1)
    assert first is not None and second is not None and first is not second
    assert pool.claim(2) is None and pool.claim(3) is None  # both packing
    first.announced(version=1, index=0, readers={"r1", "r2"})
    second.announced(version=1, index=1, readers=set())
    assert pool.claim(3) is second  # nobody maps bucket 1
    pool.release_reader("r1", 1, 0)
    assert pool.claim(2) is None
    pool.release_reader("r2", 1, 1)  # another bucket: not a release of this one
    pool.release_reader("r2", 2, 0)  # another version
    assert pool.claim(2) is None
    pool.release_reader("r2", 1, 0)
    assert pool.claim(2) is first and first.readers == set()


def test_a_bucket_lands_in_the_same_slot_every_version_even_if_another_is_free(pool):
    """Both ends keep the copies they worked out per (bucket, buffer): a bucket that moved to
    another slot had them worked out again (a version of an MoE model took 5-20 times as
    long). Bucket 0 waits for its own slot even while the other is free."""
    last = pool.claim(1)
    last.announced(version=1, index=1, readers=set())
    busy = pool.claim(0)
    busy.announced(version=1, index=0, readers={"r"})  # the previous version's bucket, unread
    assert pool.free_for(1) and not pool.free_for(0)
    assert pool.claim(0) is None  # version 2's bucket 0 does not take slot 1
    pool.release_reader("r", 1, 0)
    assert pool.claim(0) is busy and pool.claim(1) is last and pool.claim(2) is None


def test_a_failed_readers_events_are_dropped_and_the_others_kept(pool):
    slot = pool.claim(0)
    slot.announced(version=1, index=0, readers={"a", "b", "c"})
    pool.release_reader("a", 1, 0, b"event-a")
    pool.release_reader("b", 1, 0, b"event-b")
    assert slot.read_events == [ReadEvent("a", "opened:event-a"), ReadEvent("b", "opened:event-b")]
    assert not slot.free  # c has not acked
    pool.forget_reader("a")
    pool.forget_reader("c")  # failed before acking: no longer awaited
    assert slot.read_events == [ReadEvent("b", "opened:event-b")]
    assert slot.free


def test_an_abandoned_version_releases_only_its_own_slots(pool):
    old, new = pool.claim(1), pool.claim(0)
    old.announced(version=1, index=1, readers={"a"})
    new.announced(version=2, index=0, readers={"a"})
    pool.release_version(1)
    assert old.free and not new.free


def test_slots_left_packing_by_an_ended_driver_are_free_again(pool):
    pool.claim(0), pool.claim(1)
    assert not pool.free_for(0) and not pool.free_for(1)
    pool.stop_packing()
    assert pool.all_free()
