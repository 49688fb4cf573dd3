"""The per-version data path of the sender: pack, checksum, announce, broadcast, end.

One driver thread runs per version, one version packs at a time. Mixed into
:class:`~weightsync.sender.coordinator.Coordinator`, whose lock, condition and failure
bookkeeping it uses; this module holds only the path a version's bytes take.

On CUDA nothing here waits for the GPU per bucket: packing, checksums, broadcasts and the
receivers' reads are ordered by streams and interprocess events, and the driver waits once,
at the version's end, before it sends the checksums and releases the trainer's memory.
"""

from __future__ import annotations

import time
from collections import deque

import torch
from weightsync.sender.runs import VERSION_OVER, Outcome, RunAborted, Slot, VersionRun

from weightsync import trace
from weightsync.buckets import Bucket
from weightsync.checksum import ALGORITHM, finish_all, row_sums
from weightsync.errors import TransportError, WeightSyncError
from weightsync.regions import copy_pairs, region_copies
from weightsync.transports import get_transport
from weightsync.transports.base import transport_for_handle
from weightsync.transports.broadcast import PendingBroadcast
from weightsync.transports.cuda_ipc import new_event, release_event
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import error_to_pb


class VersionDriver:
    """Drives one version through the staging slots (see the module docstring)."""

    def _drive(self, run: VersionRun, device: torch.device) -> None:
        with self._drive_lock:
            try:
                self._start(run, device)
                self._connect_group(run)
                issued: deque[tuple[Bucket, Slot]] = deque()
                todo = deque(run.plan.buckets)
                while issued or todo:
                    # Every free slot gets the next bucket at once, so packing never waits for
                    # an announcement round trip between buckets.
                    self._issue_packs(run, issued, todo)
                    bucket, slot = issued[0]
                    if run.regions is not None:
                        self._pack(run, bucket, slot, device)
                    elif not self._wait_packed_or_slot(run, bucket, todo):
                        continue
                    issued.popleft()
                    self._packed(run, bucket, slot, device)
                    if self._announce(run, slot, run.layouts[bucket.index]):
                        self._broadcast(run, slot, bucket.nbytes)
                self._end(run, device)
                self._staged(run)
            except RunAborted:
                pass
            except WeightSyncError as e:
                with self._cond:
                    self._abort(run, error_to_pb(e))
            finally:
                with self._cond:
                    for slot in self._slots:
                        slot.packing = False
                    self._cond.notify_all()

    def _packed(self, run: VersionRun, bucket: Bucket, slot: Slot, device: torch.device) -> None:
        """Queue the bucket's checksum and, on CUDA, the event receivers' reads wait for."""
        run.sums[bucket.index] = row_sums(slot.buffer.tensor, bucket.nbytes)
        if slot.ready is not None:
            slot.ready[0].record(torch.cuda.current_stream(device))
        trace.mark("sender.packed", index=bucket.index)

    def _before_reuse(self, run: VersionRun, slot: Slot, device: torch.device, gpu: bool) -> None:
        """Order packing into ``slot`` after its last readers: by a stream wait when this
        process packs (``gpu``), else by waiting here (a publisher packs in its own process)."""
        after, slot.after = slot.after, []
        for work in after:
            if isinstance(work, PendingBroadcast):
                self._wait_broadcast(run, work)
            elif gpu:
                torch.cuda.current_stream(device).wait_event(work.event)
            else:
                work.event.synchronize()
        if after and not gpu and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def _issue_packs(self, run: VersionRun, issued: deque, todo: deque) -> None:
        """Give each free slot the next bucket (waits if none is in flight); ask the publishers
        to pack them unless the sender packs from their offered memory itself."""
        with self._cond:
            if not issued:
                self._wait_locked(
                    run,
                    lambda: any(s.free for s in self._slots),
                    self.settings.ack_timeout_s + 5,
                    "a free staging buffer",
                )
            fresh = []
            while todo and any(s.free for s in self._slots):
                slot = next(s for s in self._slots if s.free)
                slot.packing, slot.readers = True, set()
                bucket = todo.popleft()
                issued.append((bucket, slot))
                fresh.append((bucket, slot))
                trace.mark("sender.issue", index=bucket.index)
        if run.regions is not None:
            return  # the driver packs each itself when its turn comes
        for bucket, slot in fresh:
            self._before_reuse(run, slot, torch.device(slot.device), gpu=False)
            pack = pb.SenderReply(
                pack=pb.PackBucket(
                    version=run.version,
                    layout=run.layouts[bucket.index],
                    buffer=slot.buffer.handle,
                )
            )
            for rank in run.ranks.values():
                rank.outbox.put(pack)

    def _pack(self, run: VersionRun, bucket: Bucket, slot: Slot, device: torch.device) -> None:
        """Queue the copies that pack ``bucket`` from the publishers' mapped memory."""
        self._before_reuse(run, slot, device, gpu=device.type == "cuda")
        # The copies' views are worked out once per (regions, slot, bucket): with thousands of
        # small tensors (MoE experts) building them cost more than launching the copies.
        if self._copies[0] is not run.regions:
            self._copies = (run.regions, {})
        key = (slot.buffer.buffer_id, bucket.index)
        try:
            pairs = self._copies[1].get(key)
            if pairs is None:
                pairs = self._copies[1][key] = [
                    pair
                    for entry in bucket.entries
                    for pair in region_copies(slot.buffer.tensor, entry, run.regions[entry.name])
                ]
            copy_pairs(pairs)
        except (RuntimeError, WeightSyncError) as e:
            raise TransportError(
                f"version {run.version}: packing bucket {bucket.index} from the publishers' "
                f"memory failed: {e}"
            ) from e

    def _wait_packed_or_slot(self, run: VersionRun, bucket: Bucket, todo: deque) -> bool:
        """Wait until ``bucket`` is packed (True) or a slot frees for the next one (False)."""

        def packed() -> bool:
            return all(bucket.index in r.packed for r in run.ranks.values())

        with self._cond:
            self._wait_locked(
                run,
                lambda: packed() or (todo and any(s.free for s in self._slots)),
                self.settings.pack_timeout_s,
                f"publisher to pack bucket {bucket.index}",
            )
            return packed()

    def _start(self, run: VersionRun, device: torch.device) -> None:
        with self._cond:
            self._ensure_slots(run, device)
            start = pb.Announcement(
                start=pb.VersionStart(
                    manifest=self._first_begin(run).manifest,
                    num_buckets=len(run.plan.buckets),
                )
            )
            for conn in self._receivers.values():
                if not conn.connected:
                    continue
                outcome = run.outcomes[conn.receiver_id] = Outcome()
                if (
                    conn.data_path == "map"
                    and conn.transports
                    and (run.transport not in conn.transports)
                ):
                    self._fail(
                        run,
                        conn.receiver_id,
                        TransportError(
                            f"receiver {conn.receiver_id} opens {list(conn.transports)}, "
                            f"the sender stages with {run.transport}"
                        ),
                    )
                    continue
                outcome.expect("verdict", self.settings.ack_timeout_s)
                conn.state = "applying"
                conn.send(start)
            members = tuple(self._broadcast_members(run))
            try:
                joins = self._broadcaster.invite(members, device)
            except TransportError as e:  # fails the broadcast receivers, not the version
                joins = {}
                for rid in members:
                    self._fail(run, rid, e)
            for rid, join in joins.items():
                self._receivers[rid].send(join)
            trace.mark("sender.start", version=run.version)
            if run.direct is not None:
                self._announce_direct(run)
            self.metrics.version_started(run)

    def _announce_direct(self, run: VersionRun) -> None:
        msg = pb.Announcement(
            bucket=pb.BucketAnnouncement(
                version=run.version,
                layout=run.layouts[run.direct.index],
                sources=run.direct_sources,
            )
        )
        for rid in run.active():
            run.direct_readers.add(rid)
            run.outcomes[rid].expect(f"bucket:{run.direct.index}", self.settings.ack_timeout_s)
            self._receivers[rid].send(msg)

    @staticmethod
    def _first_begin(run: VersionRun) -> pb.BeginVersion:
        return run.ranks[min(run.ranks)].begin

    def _connect_group(self, run: VersionRun) -> None:
        """Wait for invited receivers to join the broadcast group; fail them if they don't."""
        try:
            self._broadcaster.connect()
        except TransportError as e:
            with self._cond:
                for rid in self._broadcast_members(run):
                    self._fail(run, rid, e)

    def _wait_broadcast(self, run: VersionRun, work: PendingBroadcast) -> None:
        """A failed broadcast fails the receivers that get broadcasts, not the version."""
        try:
            work.wait()
        except TransportError as e:
            self._broadcaster.close()
            with self._cond:
                for rid in self._broadcast_members(run):
                    self._fail(run, rid, e)

    def _broadcast(self, run: VersionRun, slot: Slot, nbytes: int) -> None:
        """Queue the bucket's broadcast; packing into the slot again waits for it."""
        try:
            slot.after.append(self._broadcaster.broadcast(slot.buffer.tensor[:nbytes]))
        except TransportError as e:
            with self._cond:
                for rid in self._broadcast_members(run):
                    self._fail(run, rid, e)

    def _broadcast_members(self, run: VersionRun) -> list[str]:
        return [rid for rid in run.active() if self._receivers[rid].data_path == "broadcast"]

    def _ensure_slots(self, run: VersionRun, device: torch.device) -> None:
        need = max((b.nbytes for b in run.plan.buckets), default=0) or 256
        if (
            all(s.buffer.nbytes >= need and s.device == str(device) for s in self._slots)
            and len(self._slots) == self.settings.num_buffers
        ):
            return
        self._wait_locked(
            run,
            lambda: all(s.free for s in self._slots),
            self.settings.ack_timeout_s,
            "receivers to release staging buffers",
        )
        transport = get_transport(run.transport)
        self._copies = (None, {})  # their views hold the old buffers
        for slot in self._slots:
            self._before_reuse(run, slot, torch.device(slot.device), gpu=False)
            self._free(slot)
        # Round up so small growth does not reallocate every version.
        capacity = min(max(need, 1 << 20), self.settings.bucket_size_bytes)
        capacity = max(capacity, need)
        self._slots = [
            Slot(
                transport.allocate(capacity, device),
                str(device),
                ready=new_event(device) if device.type == "cuda" else None,
            )
            for _ in range(self.settings.num_buffers)
        ]

    @staticmethod
    def _free(slot: Slot) -> None:
        if slot.ready is not None:
            release_event(slot.ready[1])
        transport_for_handle(slot.buffer.handle).release(slot.buffer)

    def _announce(self, run: VersionRun, slot: Slot, layout: pb.BucketLayout) -> bool:
        """Announce a packed bucket; returns whether broadcast receivers wait for its bytes."""
        with self._cond:
            if run.done:
                raise RunAborted()
            slot.packing, slot.version, slot.bucket_index = False, run.version, layout.index
            mapped = pb.BucketAnnouncement(
                version=run.version,
                layout=layout,
                buffer=slot.buffer.handle,
                ready_event=slot.ready[1] if slot.ready else b"",
            )
            sent = pb.BucketAnnouncement(
                version=run.version, layout=layout, group_id=self._broadcaster.group_id
            )
            any_broadcast = False
            for rid in run.active():
                conn = self._receivers[rid]
                run.outcomes[rid].expect(f"bucket:{layout.index}", self.settings.ack_timeout_s)
                if conn.data_path == "broadcast":
                    any_broadcast = True
                    conn.send(pb.Announcement(bucket=sent))
                else:
                    slot.readers.add(rid)
                    conn.send(pb.Announcement(bucket=mapped))
            trace.mark("sender.announce", index=layout.index)
            self.metrics.bucket_announced(layout.nbytes)
            self._cond.notify_all()
            return any_broadcast

    def _staged(self, run: VersionRun) -> None:
        with self._cond:
            # Direct reads come from trainer memory: it must not change until they are done.
            self._wait_locked(
                run,
                lambda: not run.direct_readers,
                self.settings.ack_timeout_s + 5,
                "receivers to copy the direct tensors",
            )
            if run.done:
                return
            run.staged_s = time.monotonic() - run.started_mono
            run.state = "staged"
            staged = pb.SenderReply(
                staged=pb.VersionStaged(version=run.version, receivers=len(run.outcomes))
            )
            for rank in run.ranks.values():
                rank.outbox.put(staged)
                if not run.notify_done:
                    rank.outbox.put(VERSION_OVER)
            self._maybe_complete(run)
            self._cond.notify_all()

    def _end(self, run: VersionRun, device: torch.device) -> None:
        """Tell receivers the version has no more buckets, with every bucket's checksum; they
        commit after checking theirs. Waits for the packing first: after this, the
        publishers' memory is no longer read."""
        for slot in self._slots:
            pending = [w for w in slot.after if isinstance(w, PendingBroadcast)]
            slot.after = [w for w in slot.after if not isinstance(w, PendingBroadcast)]
            for work in pending:
                self._wait_broadcast(run, work)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        buckets = run.plan.buckets
        checksums = finish_all([run.sums[b.index] for b in buckets], [b.nbytes for b in buckets])
        with self._cond:
            end = pb.Announcement(
                end=pb.VersionEnd(
                    version=run.version, checksum_algorithm=ALGORITHM, checksums=checksums
                )
            )
            for rid in run.active():
                run.outcomes[rid].expect("applied", self.settings.ack_timeout_s)
                self._receivers[rid].send(end)
