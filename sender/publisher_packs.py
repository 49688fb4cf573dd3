"""A version whose publishers pack its buckets (``PackBucket``), because the sender cannot
map their memory: asking them, waiting for them within their time, checking that they wrote
(:class:`Stamps`), settling when it ends.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from weightsync.buckets import Bucket
from weightsync.errors import ProtocolError, SyncTimeoutError
from weightsync.memo import Memo, Same
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

    def __init__(self, run: Version, cond: threading.Condition, places: StampPlaces):
        self._run, self._cond = run, cond
        settings = run.shared.settings
        self._stall_s, self._total_s = settings.stall_timeout_s, settings.pack_timeout_s
        self._since = time.monotonic()
        self._waited = 0.0
        self._packed = 0
        self._stamps = Stamps(places)

    def asked(self) -> None:
        """New buckets are being asked for: the stall clock restarts."""
        self._since = time.monotonic()

    def ask(self, layout: pb.BucketLayout, slot: Slot) -> None:
        """Every rank packs its part of the bucket of ``layout`` into ``slot``."""
        self._stamps.stamp(layout, slot)
        pack = pb.SenderReply()  # filled in place: nested constructors copy the layout twice
        pack.pack.version = self._run.version
        pack.pack.layout.CopyFrom(layout)
        pack.pack.buffer.CopyFrom(slot.buffer.handle)
        for rank in self._run.ranks.values():
            rank.outbox.put(pack)

    def packed_or_slot_free(self, bucket: Bucket, todo: deque[Send], slots: SlotPool) -> bool:
        """Wait until ``bucket`` is packed (True) or a slot frees for the next one (False).

        Raises:
            RunAborted: the version ended meanwhile.
            SyncTimeoutError: the publishers stalled or used up their packing time.
            ProtocolError: they said the bucket is packed, but left part of it unwritten.
        """
        run = self._run

        def packed() -> bool:
            return all(bucket.index in r.packed for r in run.ranks.values())

        with self._cond:
            while not (packed() or (todo and slots.free_for(todo[0].bucket.index))):
                if run.done:
                    raise RunAborted()
                left = self._left(bucket.index)
                began = time.monotonic()
                self._cond.wait(min(left, 1.0))
                self._waited += time.monotonic() - began
            if run.done:
                raise RunAborted()
            done = packed()
        if done:
            self._stamps.check(bucket, run.version, sorted(run.ranks))
        return done

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


ROW_BYTES = 64 * 1024
_STAMP_BYTES = 8


class Stamps:
    """Proof that publishers wrote what they said they packed: before a bucket is asked for,
    the first 8 bytes inside an entry of each 64 KiB row of its slot get a nonce drawn for
    the version (1/8192 of the bytes); after ``packed`` none may be left. Else a publisher
    that answers ``packed`` without writing would have receivers apply the slot's leftovers
    (another version's bytes) under a checksum the sender takes of them."""

    def __init__(self, places: StampPlaces) -> None:
        # One int64 word: filled and compared as a scalar, no host-to-device copy per bucket.
        self._nonce = int.from_bytes(secrets.token_bytes(_STAMP_BYTES), "little", signed=True)
        self._stamped: dict[int, tuple[Slot, list[int], torch.Tensor]] = {}
        """By bucket index: its slot, where the stamps are, and their word indices."""
        self._places = places

    def stamp(self, layout: pb.BucketLayout, slot: Slot) -> None:
        """Stamp ``slot`` for bucket ``layout`` (its readers are done with it)."""
        buffer = slot.buffer.tensor
        offsets, at = self._places(layout, buffer.device)
        _words(buffer).index_fill_(0, at, self._nonce)
        if buffer.is_cuda:  # the publisher writes from another process, after this
            torch.cuda.current_stream(buffer.device).synchronize()
        self._stamped[layout.index] = (slot, offsets, at)

    def check(self, bucket: Bucket, version: int, ranks: list[int]) -> None:
        """Every stamp of ``bucket`` was overwritten (the publishers synchronized first).

        Raises:
            ProtocolError: naming the first stamp left, its tensor and the ranks.
        """
        slot, offsets, at = self._stamped.pop(bucket.index)
        left = _words(slot.buffer.tensor).index_select(0, at) == self._nonce
        if not bool(left.any()):
            return
        offset = offsets[int(left.nonzero()[0])]
        entry = next(e for e in bucket.entries if e.offset <= offset < e.offset + e.nbytes)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks} (one of them)"
        raise ProtocolError(
            f"publisher {who} answered `packed` for bucket {bucket.index} of version {version} "
            f"but left byte {offset} of it unwritten (tensor {entry.name!r}, its byte "
            f"{entry.tensor_offset + offset - entry.offset}); a publisher writes every byte "
            "of its entries before `packed`"
        )


def stamp_offsets(entries: Iterable[tuple[int, int]]) -> list[int]:
    """Where a bucket of ``entries`` (offset, nbytes) is stamped: in each 64 KiB row, the
    first place with 8 bytes of one entry (padding between entries is never written)."""
    out: list[int] = []
    next_row = 0  # rows before it are stamped
    for offset, nbytes in sorted(entries):
        pos, end = offset, offset + nbytes
        while pos + _STAMP_BYTES <= end:
            row = pos // ROW_BYTES
            if row >= next_row:
                out.append(pos)
                next_row = row + 1
            pos = max(pos, next_row * ROW_BYTES)
    return out


class StampPlaces:
    """Where each bucket layout is stamped, kept across versions (the plans' memo gives the
    same layout objects every version, and working the places out again cost more than the
    stamping). Bounded: each entry holds 8 bytes of indices on the slot's device per 64 KiB
    of its bucket."""

    def __init__(self, max_entries: int = 64) -> None:
        self._where: Memo[tuple[Same, torch.device], tuple[list[int], torch.Tensor]] = Memo(
            max_entries
        )

    def __call__(
        self, layout: pb.BucketLayout, device: torch.device
    ) -> tuple[list[int], torch.Tensor]:
        """The stamps' offsets in ``layout``'s bucket, and the indices of their 8-byte words
        on ``device`` (entries start at multiples of 256 bytes, rows of 64 KiB: every stamp
        is a whole word)."""

        def where() -> tuple[list[int], torch.Tensor]:
            offsets = stamp_offsets((e.offset, e.nbytes) for e in layout.entries)
            words = [offset // _STAMP_BYTES for offset in offsets]
            return offsets, torch.tensor(words, dtype=torch.int64, device=device)

        return self._where.get((Same(layout), device), where)


def _words(buffer: torch.Tensor) -> torch.Tensor:
    """A slot's bytes as 8-byte words (its tail past the last whole word holds no stamp)."""
    return buffer[: buffer.numel() // _STAMP_BYTES * _STAMP_BYTES].view(torch.int64)
