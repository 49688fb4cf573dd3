"""A version whose publishers pack its buckets (``PackBucket``), because the sender cannot
map their memory: asking them, waiting for them within their time, settling when it ends.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from weightsync.buckets import Bucket
from weightsync.config import SenderSettings
from weightsync.errors import SyncTimeoutError
from weightsync.sender.records import RunAborted
from weightsync.sender.slots import Slot, SlotPool
from weightsync.v1 import weightsync_pb2 as pb

if TYPE_CHECKING:
    from weightsync.sender.announcements import Send
    from weightsync.sender.version import Version


MAX_LENT = 8
"""Staging slots at most lent to publishers of ended versions at once (each a bucket's
buffer): past it, a version that ends early waits for its publishers as before."""


class PublisherPacks:
    """The publishers' packing of ``run``: they may keep the sender waiting at most
    ``stall_timeout_s`` since they last packed a bucket or were asked for one, and at most
    ``pack_timeout_s`` in all."""

    def __init__(self, run: Version, cond: threading.Condition, settings: SenderSettings):
        self._run, self._cond = run, cond
        self._stall_s, self._total_s = settings.stall_timeout_s, settings.pack_timeout_s
        self._since = time.monotonic()
        self._waited = 0.0
        self._packed = 0

    def asked(self) -> None:
        """New buckets are being asked for: the stall clock restarts."""
        self._since = time.monotonic()

    def ask(self, layout: pb.BucketLayout, slot: Slot) -> None:
        """Every rank packs its part of the bucket of ``layout`` into ``slot``."""
        pack = pb.SenderReply(
            pack=pb.PackBucket(version=self._run.version, layout=layout, buffer=slot.buffer.handle)
        )
        for rank in self._run.ranks.values():
            rank.outbox.put(pack)

    def packed_or_slot_free(self, bucket: Bucket, todo: deque[Send], slots: SlotPool) -> bool:
        """Wait until ``bucket`` is packed (True) or a slot frees for the next one (False).

        Raises:
            RunAborted: the version ended meanwhile.
            SyncTimeoutError: the publishers stalled or used up their packing time.
        """
        run = self._run

        def packed() -> bool:
            return all(bucket.index in r.packed for r in run.ranks.values())

        with self._cond:
            while not (packed() or (todo and slots.any_free())):
                if run.done:
                    raise RunAborted()
                left = self._left(bucket.index)
                began = time.monotonic()
                self._cond.wait(min(left, 1.0))
                self._waited += time.monotonic() - began
            if run.done:
                raise RunAborted()
            return packed()

    def release(self, issued: Iterable[tuple[Send, Slot]], slots: SlotPool) -> None:
        """The version ended early (lock held): nothing may write into a slot once it is
        reused, and ranks still there may yet pack the buckets they were asked for. Those
        slots are lent to them (:meth:`SlotPool.lend`): the next version packs into new ones
        at once. Past :data:`MAX_LENT` lent slots, wait for the ranks instead (at most
        ``stall_timeout_s``: a stalled one is not waited for)."""
        ranks = list(self._run.ranks.values())
        pending = [
            (slot, send.bucket.index)
            for send, slot in issued
            if any(not (r.left or send.bucket.index in r.packed) for r in ranks)
        ]
        if slots.lent + len(pending) > MAX_LENT:
            self._settle({index for _, index in pending})
            return
        for slot, index in pending:
            slots.lend(slot, lambda i=index: all(r.left or i in r.packed for r in ranks))

    def _settle(self, asked: set[int]) -> None:
        deadline = time.monotonic() + self._stall_s
        ranks = self._run.ranks.values()
        while any(not (r.left or asked <= r.packed) for r in ranks):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(min(left, 1.0))

    def _left(self, index: int) -> float:
        """Seconds the sender may still wait for bucket ``index``; raises SyncTimeoutError
        when none."""
        run, now = self._run, time.monotonic()
        packed = sum(len(r.packed) for r in run.ranks.values())
        if packed != self._packed:
            self._packed, self._since = packed, now
        stall_left = self._since + self._stall_s - now
        total_left = self._total_s - self._waited
        if total_left <= 0:
            raise SyncTimeoutError(
                f"version {run.version}: the publishers kept the sender waiting "
                f"{self._total_s:g} s in all (pack_timeout_s, WEIGHTSYNC_PACK_TIMEOUT_S); "
                f"last waited for bucket {index}"
            )
        if stall_left <= 0:
            missing = [r.rank for r in run.ranks.values() if index not in r.packed]
            raise SyncTimeoutError(
                f"version {run.version}: the publishers packed nothing for {self._stall_s:g} s "
                f"(stall_timeout_s, WEIGHTSYNC_STALL_TIMEOUT_S) while the sender waited for "
                f"bucket {index} from rank(s) {missing}"
            )
        return min(stall_left, total_left)
