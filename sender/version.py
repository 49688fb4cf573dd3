"""A version as the sender runs it: planned, then started, its buckets sent, ended, staged.

:meth:`Version.run` holds the steps in order. The receivers' replies (verdicts, acks,
applied) are fed to the version by ``outcomes.py``: they free slots, stage the version
once the last direct read ends, and finish it. Nothing here waits for the GPU per bucket: on
CUDA, packing, checksums, broadcasts and the receivers' reads are ordered by streams and
interprocess events, and the version waits once, at its end (``VersionDriver.end``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from weightsync import trace
from weightsync.buckets import Bucket
from weightsync.checksum import row_sums
from weightsync.errors import WeightSyncError
from weightsync.sender.broadcast import Members
from weightsync.sender.packing import pack_bucket
from weightsync.sender.planner import BROADCAST, MAP
from weightsync.sender.publisher_packs import PublisherPacks
from weightsync.sender.records import ReceiverConn, RunAborted, VersionRun
from weightsync.sender.slices import SliceGroup
from weightsync.sender.slots import Slot
from weightsync.sender.states import VersionState
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import error_to_pb

if TYPE_CHECKING:
    from weightsync.sender.driver import VersionDriver


class Send(NamedTuple):
    """One bucket to pack and send: a staged bucket (``group`` None: to the receivers that map
    and those that get the staged buckets by broadcast) or a slice group's."""

    bucket: Bucket
    layout: pb.BucketLayout
    group: SliceGroup | None


class Version(VersionRun):
    """A planned version (its record: :class:`VersionRun`) and the steps that send it."""

    def run(
        self, driver: VersionDriver, device: torch.device, start: Callable[[], list[Send]]
    ) -> None:
        """Send the version, staged on ``device``, from its start to staged (``start``
        addresses it to the receivers, or returns what an earlier start made). The version
        ends here when it is abandoned or fails: its publishers hear at once."""
        packs = PublisherPacks(self, driver.cond, driver.settings) if self.regions is None else None
        issued: deque[tuple[Send, Slot]] = deque()
        try:
            todo = deque(start())
            ended = not todo  # then the end went with the start
            driver.broadcast.connect(self)
            while issued or todo:
                # Every free slot gets the next bucket at once, so packing never waits for
                # an announcement round trip between buckets.
                self._claim_slots(driver, issued, todo, packs)
                send, slot = issued[0]
                if packs is None:
                    driver.before_reuse(slot, device, on_stream=device.type == "cuda")
                    sums = pack_bucket(self, send.bucket, slot)
                elif packs.packed_or_slot_free(send.bucket, todo, driver.slots):
                    sums = None
                else:
                    continue  # a slot freed first: it gets the next bucket
                issued.popleft()
                self._checksum(send.bucket, slot, device, sums)
                members = self._announce(driver, slot, send)
                if members:
                    driver.broadcast.send(self, slot, send.bucket.nbytes, members)
            if not ended:
                driver.end(self, device)
            self._staged(driver)
        except RunAborted:
            if self.abandoned is None:
                self._release_publishers(driver, issued, device, packs)
        except WeightSyncError as e:
            with driver.cond:
                driver.outcomes.abort(self, error_to_pb(e))
        finally:
            with driver.cond:
                driver.slots.stop_packing()
                driver.cond.notify_all()

    def start(self, driver: VersionDriver, device: torch.device) -> list[Send]:
        """Address the version to the receivers: its start, the direct bucket if it has one,
        and its end if it stages nothing, to each receiver in one message; returns the buckets
        to stage (:meth:`sends`: they depend on whom it was addressed to)."""
        with driver.cond:
            if self.done:
                # Abandoned while it queued behind another version (its publisher gave up
                # or left): announcing it would leave receivers inside a version that never
                # ends, failing the next one.
                raise RunAborted()
            driver.ensure_slots(self, device)
            outcomes = driver.outcomes
            with outcomes.together():
                outcomes.open_version(self, _starts(self))
                driver.broadcast.invite(self, device)
                trace.mark("sender.start", version=self.version)
                if self.tensors.direct is not None:
                    self._announce_direct(driver)
                    trace.mark("sender.direct_announced", version=self.version)
                sends = self.sends()
                if not sends:
                    driver.send_end(self)
            driver.metrics.version_started(self.version)
            return sends

    def sends(self) -> list[Send]:
        """Every bucket to send, in order: the staged ones (unless every receiver is in a
        slice group), then each slice group's."""
        everyone_sliced = bool(self.slices) and set(self.outcomes) <= self.sliced
        staged = () if everyone_sliced else self.tensors.staged.buckets
        sends = [Send(b, self.tensors.layouts[b.index], None) for b in staged]
        for group in self.slices:
            sends += [
                Send(b, layout, group)
                for b, layout in zip(group.plan.buckets, group.layouts, strict=True)
            ]
        return sends

    def largest_bucket(self) -> int:
        """Bytes every staging slot must hold (at least 256)."""
        buckets = [*self.tensors.staged.buckets, *(b for g in self.slices for b in g.plan.buckets)]
        return max((b.nbytes for b in buckets), default=0) or 256

    def _announce_direct(self, driver: VersionDriver) -> None:
        """Each receiver gets its own direct bucket (its nearest copies); one that registered
        after the plan reads the lowest ranks' copies."""
        direct = self.tensors.direct

        def own(conn: ReceiverConn) -> pb.Announcement:
            read = self.direct_reads.get(conn.receiver_id)
            if read is None:
                return pb.Announcement(
                    bucket=pb.BucketAnnouncement(
                        version=self.version,
                        layout=self.tensors.layouts[direct.index],
                        sources=self.tensors.direct_sources,
                    )
                )
            bucket = pb.BucketAnnouncement(version=self.version, layout_key=read.key)
            # A receiver that keeps layouts gets the key alone once it has the layout: listing
            # every tensor again costs the sender and each receiver per version.
            if not conn.layout_keys or conn.layouts_sent.needs(read.key):
                bucket.layout.CopyFrom(read.layout)
                bucket.sources.extend(read.sources)
            return pb.Announcement(bucket=bucket)

        for conn in driver.outcomes.address(self, f"bucket:{direct.index}", own):
            self.direct_readers.add(conn.receiver_id)

    def _claim_slots(
        self,
        driver: VersionDriver,
        issued: deque[tuple[Send, Slot]],
        todo: deque[Send],
        packs: PublisherPacks | None,
    ) -> None:
        """Give each free slot the next bucket (waits for one if none is in flight); the
        publishers are asked to pack them when they pack."""
        with driver.cond:
            if self.done:
                raise RunAborted()
            if not issued:
                driver.wait(
                    self,
                    driver.slots.any_free,
                    driver.settings.ack_timeout_s + 5,
                    "a free staging buffer",
                )
            fresh = []
            while todo and (slot := driver.slots.claim()) is not None:
                send = todo.popleft()
                issued.append((send, slot))
                fresh.append((send, slot))
                trace.mark("sender.issue", index=send.bucket.index)
        if packs is not None and fresh:
            packs.asked()
            for send, slot in fresh:
                driver.before_reuse(slot, torch.device(slot.device), on_stream=False)
                packs.ask(send.layout, slot)

    def _checksum(
        self, bucket: Bucket, slot: Slot, device: torch.device, sums: torch.Tensor | None
    ) -> None:
        """Queue the bucket's checksum (unless the pack took it: ``sums``) and, on CUDA, the
        event receivers' reads wait for."""
        self.sums[bucket.index] = (
            sums if sums is not None else row_sums(slot.buffer.tensor, bucket.nbytes)
        )
        if slot.packed_event is not None:
            slot.packed_event[0].record(torch.cuda.current_stream(device))
        trace.mark("sender.checksum_queued", index=bucket.index)
        trace.gpu_mark("sender.gpu_packed", device, index=bucket.index)

    def _announce(self, driver: VersionDriver, slot: Slot, send: Send) -> Members:
        """Announce a packed bucket to its receivers; returns the broadcast group that waits
        for its bytes (empty: none)."""
        layout = send.layout
        with driver.cond:
            if self.done:
                raise RunAborted()
            if send.group is None:
                members = driver.broadcast.staged_members(self)

                def to(rid: str) -> bool:
                    return rid not in self.sliced

            else:
                members = send.group.members
                to = set(members).__contains__
            mapped = pb.Announcement(
                bucket=pb.BucketAnnouncement(
                    version=self.version,
                    layout=layout,
                    buffer=slot.buffer.handle,
                    ready_event=slot.packed_event[1] if slot.packed_event else b"",
                )
            )
            group_id = driver.broadcast.group_id(members)
            sent = pb.Announcement(
                bucket=pb.BucketAnnouncement(version=self.version, layout=layout, group_id=group_id)
            )
            conns = driver.outcomes.address(
                self,
                f"bucket:{layout.index}",
                lambda c: sent if c.data_path == BROADCAST else mapped,
                to,
            )
            readers = {c.receiver_id for c in conns if c.data_path == MAP}
            slot.announced(self.version, layout.index, readers)
            trace.mark("sender.announce", index=layout.index)
            driver.metrics.bucket_announced(layout.nbytes)
            driver.cond.notify_all()
            return members if any(c.data_path == BROADCAST for c in conns) else ()

    def _staged(self, driver: VersionDriver) -> None:
        """Every bucket and the end are sent: the version is staged once no receiver still
        reads direct tensors from the publishers' memory (which must not change until then).
        The last such read's ack, or the failure of its receiver, stages it where it arrives:
        waking the driver for it cost latency."""
        with driver.cond:
            if self.done:
                raise RunAborted()
            self.state = VersionState.READING
            driver.outcomes.reads_done(self)

    def _release_publishers(
        self,
        driver: VersionDriver,
        issued: deque[tuple[Send, Slot]],
        device: torch.device,
        packs: PublisherPacks | None,
    ) -> None:
        """The version ended early, every receiver having failed: the publishers are told at
        once (``staged``, and ``done`` when they wait for it) instead of packing buckets
        nobody reads, once nothing of theirs is being read or written: the sender's copies
        from their memory are finished, the buckets they were asked to pack are packed
        (:meth:`PublisherPacks.settle`)."""
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        with driver.cond:
            if packs is not None:
                packs.settle({send.bucket.index for send, _ in issued})
            self.tell_staged()
            self.tell_done()


def _starts(version: Version) -> Callable[[ReceiverConn], pb.Announcement]:
    """Each receiver's start: the manifest (or its key alone, for a receiver that holds it)
    and how many buckets it gets; receivers alike share one message."""
    counts = {rid: len(g.plan.buckets) for g in version.slices for rid in g.members}
    starts: dict[tuple[int, bool], pb.Announcement] = {}

    def start(conn: ReceiverConn) -> pb.Announcement:
        n = counts.get(conn.receiver_id, len(version.tensors.staged.buckets))
        whole = not conn.manifest_keys or conn.manifests_sent.needs(version.manifest_key)
        if (n, whole) not in starts:
            manifest = version.manifest_pb if whole else pb.Manifest(version=version.version)
            starts[n, whole] = pb.Announcement(
                start=pb.VersionStart(
                    manifest=manifest, num_buckets=n, manifest_key=version.manifest_key
                )
            )
        return starts[n, whole]

    return start
