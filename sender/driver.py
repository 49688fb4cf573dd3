"""The version driver: executes one version's plan through the staging slots.

One thread drives the versions in turn (started once: a thread per version cost about 0.3 ms
of every version's latency): address the receivers and
invite the broadcast ones, then for each staged bucket take a free slot, pack it (the sender
from the offered memory, or the publishers when asked), queue its checksum, announce it and
queue its broadcast; then send every checksum. The version is staged (its publishers' memory
free again) where the last receiver's read of direct tensors ends, not on this thread.

On CUDA nothing here waits for the GPU per bucket: packing, checksums, broadcasts and the
receivers' reads are ordered by streams and interprocess events, and the driver waits once,
at the version's end, before it sends the checksums and releases the trainer's memory.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import torch

from weightsync import trace
from weightsync.buckets import Bucket
from weightsync.checksum import ALGORITHM, finish_all, row_sums
from weightsync.config import SenderSettings
from weightsync.errors import SyncTimeoutError, TransportError, WeightSyncError
from weightsync.metrics import SenderMetrics
from weightsync.sender.broadcast import Members, SenderBroadcast
from weightsync.sender.outcomes import Outcomes
from weightsync.sender.packing import pack_bucket
from weightsync.sender.planner import BROADCAST, MAP
from weightsync.sender.records import ReceiverConn, RunAborted, VersionRun
from weightsync.sender.slices import SliceGroup
from weightsync.sender.slots import Slot, SlotPool
from weightsync.transports import get_transport
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import error_to_pb

log = logging.getLogger("weightsync.sender")


class _Send(NamedTuple):
    """One bucket to pack and send: a staged bucket (``group`` None: to the receivers that map
    and those that get the staged buckets by broadcast) or a slice group's."""

    bucket: Bucket
    layout: pb.BucketLayout
    group: SliceGroup | None


def _sends(run: VersionRun) -> list[_Send]:
    """Every bucket of ``run`` to send, in order: the staged ones (unless every receiver is in
    a slice group), then each slice group's."""
    everyone_sliced = bool(run.slices) and set(run.outcomes) <= run.sliced
    staged = () if everyone_sliced else run.tensors.staged.buckets
    sends = [_Send(b, run.tensors.layouts[b.index], None) for b in staged]
    for group in run.slices:
        sends += [
            _Send(b, layout, group)
            for b, layout in zip(group.plan.buckets, group.layouts, strict=True)
        ]
    return sends


def _largest_bucket(run: VersionRun) -> int:
    """Bytes every staging slot must hold for ``run`` (at least 256)."""
    buckets = [*run.tensors.staged.buckets, *(b for g in run.slices for b in g.plan.buckets)]
    return max((b.nbytes for b in buckets), default=0) or 256


class _Queued:
    """A version for the driver thread: its start already made by the thread that began it
    (``started`` set once it was), or left to the driver."""

    def __init__(self, run: VersionRun, device: torch.device, inline: bool) -> None:
        self.run, self.device = run, device
        self.started: threading.Event | None = threading.Event() if inline else None
        self._sends: list[_Send] | BaseException = []

    def made(self, sends: list[_Send] | BaseException) -> None:
        self._sends = sends
        self.started.set()

    def sends(self) -> list[_Send]:
        """What the inline start returned, or the exception it raised."""
        self.started.wait()
        if isinstance(self._sends, BaseException):
            raise self._sends
        return self._sends


class VersionDriver:
    """Runs versions one at a time; ``cond`` is the sender's lock (see ``outcomes.py``)."""

    def __init__(
        self,
        cond: threading.Condition,
        settings: SenderSettings,
        metrics: SenderMetrics,
        outcomes: Outcomes,
        slots: SlotPool,
        broadcast: SenderBroadcast,
    ) -> None:
        self._cond, self._settings, self._metrics = cond, settings, metrics
        self._outcomes, self._slots, self._broadcast = outcomes, slots, broadcast
        self._queued: queue.Queue[_Queued | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._idle = True
        """No version queued or being driven (``_lock``)."""
        self._closed = False
        self._lock = threading.Lock()
        """Orders ``start`` and ``close``: nothing is queued behind the thread's end."""

    def start(self, run: VersionRun, device: torch.device) -> None:
        """Drive ``run``, staged on ``device``, after the versions started before it. When
        nothing is ahead of it and its staging buffers are in place, its start goes to the
        receivers from this thread (waking the driver thread first cost about 0.2 ms).

        Raises:
            TransportError: the sender is shutting down (:meth:`close`).
        """
        with self._lock:
            if self._closed:
                raise TransportError(
                    "the sender is shutting down; publish the version again once it is back"
                )
            if self._thread is None:
                self._thread = threading.Thread(target=self._drive_all, name="driver", daemon=True)
                self._thread.start()
            inline = self._idle and self._slots.fits(_largest_bucket(run), device)
            item = _Queued(run, device, inline)
            self._idle = False
            self._queued.put(item)
        if item.started is not None:
            try:
                sends = self._start(run, device)
            except BaseException as e:
                item.made(e)
            else:
                item.made(sends)

    def close(self) -> None:
        """The driver thread ends after the version it drives; later versions fail to start."""
        with self._lock:
            self._closed = True
            self._queued.put(None)

    def _drive_all(self) -> None:
        while (item := self._queued.get()) is not None:
            run = item.run
            try:
                self.drive(item)
            except Exception as e:
                # A bug must fail its version, not every later one with the thread.
                log.exception("version %d: the driver failed", run.version)
                with self._cond:
                    self._outcomes.abort(
                        run, error_to_pb(WeightSyncError(f"{type(e).__name__}: {e}"))
                    )
            with self._lock:
                self._idle = self._queued.empty()

    def drive(self, item: _Queued) -> None:
        run, device = item.run, item.device
        clock = _PublisherClock(self._settings)
        issued: deque[tuple[_Send, Slot]] = deque()
        try:
            todo = deque(item.sends() if item.started is not None else self._start(run, device))
            ended = not todo  # then the end went with the start
            self._broadcast.connect(run)
            while issued or todo:
                # Every free slot gets the next bucket at once, so packing never waits for
                # an announcement round trip between buckets.
                self._issue_packs(run, issued, todo, clock)
                send, slot = issued[0]
                sums = None
                if run.regions is not None:
                    self._before_reuse(run, slot, device, on_stream=device.type == "cuda")
                    sums = pack_bucket(run, send.bucket, slot)
                elif not self._wait_packed_or_slot(run, send.bucket, todo, clock):
                    continue
                issued.popleft()
                self._packed(run, send.bucket, slot, device, sums)
                members = self._announce(run, slot, send)
                if members:
                    self._broadcast.send(run, slot, send.bucket.nbytes, members)
            if not ended:
                self._end(run, device)
            self._staged(run)
        except RunAborted:
            if run.abandoned is None:
                self._release_publishers(run, issued, device)
        except WeightSyncError as e:
            with self._cond:
                self._outcomes.abort(run, error_to_pb(e))
        finally:
            with self._cond:
                self._slots.stop_packing()
                self._cond.notify_all()

    def _start(self, run: VersionRun, device: torch.device) -> list[_Send]:
        """Address ``run`` to the receivers: its start, the direct bucket if it has one, and
        its end if it stages nothing, to each receiver in one message; returns the buckets
        to stage (:func:`_sends`: they depend on whom the version was addressed to)."""
        with self._cond:
            if run.done:
                # Abandoned while it queued behind another version (its publisher gave up
                # or left): announcing it would leave receivers inside a version that never
                # ends, failing the next one.
                raise RunAborted()
            self._ensure_slots(run, device)
            counts = {rid: len(g.plan.buckets) for g in run.slices for rid in g.members}
            starts: dict[tuple[int, bool], pb.Announcement] = {}

            def start(conn: ReceiverConn) -> pb.Announcement:
                n = counts.get(conn.receiver_id, len(run.tensors.staged.buckets))
                # A receiver that holds the manifest gets its key and version alone.
                whole = not conn.manifest_keys or conn.manifests_sent.needs(run.manifest_key)
                if (n, whole) not in starts:
                    manifest = run.manifest_pb if whole else pb.Manifest(version=run.version)
                    starts[n, whole] = pb.Announcement(
                        start=pb.VersionStart(
                            manifest=manifest, num_buckets=n, manifest_key=run.manifest_key
                        )
                    )
                return starts[n, whole]

            with self._outcomes.together():
                self._outcomes.open_version(run, start)
                self._broadcast.invite(run, device)
                trace.mark("sender.start", version=run.version)
                if run.tensors.direct is not None:
                    self._announce_direct(run)
                    trace.mark("sender.direct_announced", version=run.version)
                sends = _sends(run)
                if not sends:
                    self._send_end(run)
            self._metrics.version_started(run.version)
            return sends

    def _ensure_slots(self, run: VersionRun, device: torch.device) -> None:
        """Slots on ``device`` that hold the largest bucket (reallocated once all are free)."""
        need = _largest_bucket(run)
        if self._slots.fits(need, device):
            return
        self._wait(
            run,
            self._slots.all_free,
            self._settings.ack_timeout_s,
            "receivers to release staging buffers",
        )
        for slot in self._slots.slots:
            self._before_reuse(run, slot, torch.device(slot.device), on_stream=False)
        self._slots.reallocate(need, device, get_transport(run.transport))

    def _announce_direct(self, run: VersionRun) -> None:
        """Each receiver gets its own direct bucket (its nearest copies); one that registered
        after the plan reads the lowest ranks' copies."""
        direct = run.tensors.direct

        def own(conn: ReceiverConn) -> pb.Announcement:
            read = run.direct_reads.get(conn.receiver_id)
            if read is None:
                return pb.Announcement(
                    bucket=pb.BucketAnnouncement(
                        version=run.version,
                        layout=run.tensors.layouts[direct.index],
                        sources=run.tensors.direct_sources,
                    )
                )
            bucket = pb.BucketAnnouncement(version=run.version, layout_key=read.key)
            # Listing every tensor again costs the sender and each receiver about a
            # millisecond per version for a 7B model: a receiver that keeps layouts gets the
            # key alone once it has the layout.
            if not conn.layout_keys or conn.layouts_sent.needs(read.key):
                bucket.layout.CopyFrom(read.layout)
                bucket.sources.extend(read.sources)
            return pb.Announcement(bucket=bucket)

        for conn in self._outcomes.address(run, f"bucket:{direct.index}", own):
            run.direct_readers.add(conn.receiver_id)

    def _before_reuse(
        self, run: VersionRun, slot: Slot, device: torch.device, on_stream: bool
    ) -> None:
        """Order packing into ``slot`` after its last readers: by a stream wait when this
        process packs on the GPU (``on_stream``), else by waiting here (a publisher packs in
        its own process)."""
        broadcast = self._broadcast.finish(slot)
        events, slot.read_events = slot.read_events, []
        for read in events:
            if on_stream:
                torch.cuda.current_stream(device).wait_event(read.event)
            else:
                read.event.synchronize()
        if (broadcast or events) and not on_stream and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def _issue_packs(
        self, run: VersionRun, issued: deque, todo: deque, clock: _PublisherClock
    ) -> None:
        """Give each free slot the next bucket (waits if none is in flight); ask the publishers
        to pack them unless the sender packs from their offered memory itself."""
        with self._cond:
            if run.done:
                raise RunAborted()
            if not issued:
                self._wait(
                    run,
                    self._slots.any_free,
                    self._settings.ack_timeout_s + 5,
                    "a free staging buffer",
                )
            fresh = []
            while todo and (slot := self._slots.claim()) is not None:
                send = todo.popleft()
                issued.append((send, slot))
                fresh.append((send, slot))
                trace.mark("sender.issue", index=send.bucket.index)
        if run.regions is not None:
            return  # the driver packs each itself when its turn comes
        if fresh:
            clock.asked()
        for send, slot in fresh:
            self._before_reuse(run, slot, torch.device(slot.device), on_stream=False)
            pack = pb.SenderReply(
                pack=pb.PackBucket(
                    version=run.version, layout=send.layout, buffer=slot.buffer.handle
                )
            )
            for rank in run.ranks.values():
                rank.outbox.put(pack)

    def _wait_packed_or_slot(
        self, run: VersionRun, bucket: Bucket, todo: deque, clock: _PublisherClock
    ) -> bool:
        """Wait until ``bucket`` is packed (True) or a slot frees for the next one (False);
        SyncTimeoutError once the publishers stall or use up their packing time."""

        def packed() -> bool:
            return all(bucket.index in r.packed for r in run.ranks.values())

        with self._cond:
            while not (packed() or (todo and self._slots.any_free())):
                if run.done:
                    raise RunAborted()
                left = clock.left(run, bucket.index)
                began = time.monotonic()
                self._cond.wait(min(left, 1.0))
                clock.waited(time.monotonic() - began)
            if run.done:
                raise RunAborted()
            return packed()

    def _release_publishers(
        self, run: VersionRun, issued: deque[tuple[_Send, Slot]], device: torch.device
    ) -> None:
        """``run`` ended early, every receiver having failed: the publishers are told at once
        (``staged``, and ``done`` when they wait for it) instead of packing buckets nobody
        reads, once nothing of theirs is being read or written: the sender's copies from
        their memory are finished and the buckets they were asked to pack are packed (by
        ranks still there, at most ``stall_timeout_s``: a stalled one is not waited for)."""
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        deadline = time.monotonic() + self._settings.stall_timeout_s
        with self._cond:
            if run.regions is None:
                asked = {send.bucket.index for send, _ in issued}
                while any(not (r.left or asked <= r.packed) for r in run.ranks.values()):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(min(left, 1.0))
            self._outcomes.tell_staged(run)
            self._outcomes.tell_done(run)

    def _packed(
        self,
        run: VersionRun,
        bucket: Bucket,
        slot: Slot,
        device: torch.device,
        sums: torch.Tensor | None,
    ) -> None:
        """Queue the bucket's checksum (unless the pack took it: ``sums``) and, on CUDA, the
        event receivers' reads wait for."""
        run.sums[bucket.index] = (
            sums if sums is not None else row_sums(slot.buffer.tensor, bucket.nbytes)
        )
        if slot.packed_event is not None:
            slot.packed_event[0].record(torch.cuda.current_stream(device))
        trace.mark("sender.checksum_queued", index=bucket.index)
        trace.gpu_mark("sender.gpu_packed", device, index=bucket.index)

    def _announce(self, run: VersionRun, slot: Slot, send: _Send) -> Members:
        """Announce a packed bucket to its receivers; returns the broadcast group that waits
        for its bytes (empty: none)."""
        layout = send.layout
        with self._cond:
            if run.done:
                raise RunAborted()
            if send.group is None:
                members = self._broadcast.staged_members(run)

                def to(rid: str) -> bool:
                    return rid not in run.sliced

            else:
                members = send.group.members
                to = set(members).__contains__
            mapped = pb.Announcement(
                bucket=pb.BucketAnnouncement(
                    version=run.version,
                    layout=layout,
                    buffer=slot.buffer.handle,
                    ready_event=slot.packed_event[1] if slot.packed_event else b"",
                )
            )
            sent = pb.Announcement(
                bucket=pb.BucketAnnouncement(
                    version=run.version, layout=layout, group_id=self._broadcast.group_id(members)
                )
            )
            conns = self._outcomes.address(
                run,
                f"bucket:{layout.index}",
                lambda c: sent if c.data_path == BROADCAST else mapped,
                to,
            )
            readers = {c.receiver_id for c in conns if c.data_path == MAP}
            slot.announced(run.version, layout.index, readers)
            trace.mark("sender.announce", index=layout.index)
            self._metrics.bucket_announced(layout.nbytes)
            self._cond.notify_all()
            return members if any(c.data_path == BROADCAST for c in conns) else ()

    def _end(self, run: VersionRun, device: torch.device) -> None:
        """Tell receivers the version has no more buckets, with every bucket's checksum; they
        commit after checking theirs. Waits for the packing first: after this, the
        publishers' memory is no longer read."""
        for slot in self._slots.slots:
            self._broadcast.finish(slot)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        trace.flush_gpu()
        with self._cond:
            self._send_end(run)

    def _send_end(self, run: VersionRun) -> None:
        """Every receiver still in ``run`` gets its end, with every bucket's checksum (lock
        held)."""
        sent = [s.bucket for s in _sends(run)]
        values = dict(
            zip(
                [b.index for b in sent],
                finish_all([run.sums[b.index] for b in sent], [b.nbytes for b in sent]),
                strict=True,
            )
        )
        # By index; 0 for the staged buckets nobody took (every receiver in a slice group).
        checksums = [values.get(i, 0) for i in range(max(values, default=-1) + 1)]
        end = pb.Announcement(
            end=pb.VersionEnd(
                version=run.version, checksum_algorithm=ALGORITHM, checksums=checksums
            )
        )
        self._outcomes.address(run, "applied", lambda c: end)

    def _staged(self, run: VersionRun) -> None:
        """Every bucket and the end are sent: ``run`` is staged once no receiver still reads
        direct tensors from the publishers' memory (which must not change until then). The
        last such read's ack, or the failure of its receiver, stages it where it arrives; the
        driver does not wait for it (waking the driver cost about 0.3 ms per version)."""
        with self._cond:
            if run.done:
                raise RunAborted()
            run.state = "reading"
            self._outcomes.reads_done(run)

    def _wait(
        self, run: VersionRun, ready: Callable[[], object], timeout_s: float, what: str
    ) -> None:
        """Wait (lock held) until ``ready()``; RunAborted once ``run`` is over."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if run.done:
                raise RunAborted()
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncTimeoutError(
                    f"version {run.version}: waited {timeout_s:.0f} s for {what}"
                )
            self._cond.wait(min(left, 1.0))
        if run.done:
            raise RunAborted()


class _PublisherClock:
    """How long one version's driver waited for its publishers' packing: at most
    ``stall_timeout_s`` since they last packed a bucket or were asked for one, and at most
    ``pack_timeout_s`` in all."""

    def __init__(self, settings: SenderSettings) -> None:
        self._stall_s, self._total_s = settings.stall_timeout_s, settings.pack_timeout_s
        self._since = time.monotonic()
        self._waited = 0.0
        self._packed = 0

    def asked(self) -> None:
        """New buckets were asked for: the stall clock restarts."""
        self._since = time.monotonic()

    def waited(self, seconds: float) -> None:
        self._waited += seconds

    def left(self, run: VersionRun, index: int) -> float:
        """Seconds the driver may still wait (lock held); raises SyncTimeoutError when none."""
        now = time.monotonic()
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
