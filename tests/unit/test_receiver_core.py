"""ReceiverCore's pieces without a sender: the bucket reader over shm staging buffers, and the
version state machine driven by an in-memory connection."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from tests.support.raw_streams import MemoryConnection
from tests.support.waiting import wait_until
from weightsync.buckets import (
    BucketPlan,
    TensorSpec,
    byte_view,
    pack_entry,
    plan_buckets,
    plan_direct,
)
from weightsync.checksum import ALGORITHM, finish_all, row_sums
from weightsync.errors import (
    ChecksumError,
    ManifestMismatchError,
    PlanError,
    ProtocolError,
    ReceiverFailedError,
    SyncTimeoutError,
    TransportError,
    WeightSyncError,
)
from weightsync.manifest import VersionManifest, VersionPartSpec, plan_digest
from weightsync.receiver import target as target_module
from weightsync.receiver.connection import KeptByStream
from weightsync.receiver.core import ReceiverCore
from weightsync.receiver.inbox import Inbox, SenderLost
from weightsync.receiver.links import HeldAcks, ack_or_fold
from weightsync.receiver.reader import BucketReader, VersionReads
from weightsync.receiver.target import Arrival, InPlaceTarget, WeightTarget, assembled
from weightsync.regions import Region
from weightsync.topology_model import Box
from weightsync.transports import get_transport
from weightsync.transports.base import StagingBuffer
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import bucket_to_pb, manifest_to_pb

CPU = torch.device("cpu")
CAP = 512  # bytes per bucket: "big" (1200 bytes) is split into three chunks


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(4, 8, generator=g),  # 128 bytes
        "b": torch.randn(64, generator=g),  # 256 bytes
        "big": torch.randn(300, generator=g),  # 1200 bytes: chunked
        "c": torch.randint(0, 100, (8,), generator=g),  # int64, 64 bytes
    }


class Recorder(WeightTarget):
    """Writes into ``live`` by name and records every call the core makes."""

    def __init__(self, live: dict[str, torch.Tensor]) -> None:
        self.device = CPU
        self.live = live
        self.calls: list[str] = []
        self.loaded: list[list[str]] = []
        """Names per ``load`` call."""
        self.aborted: WeightSyncError | None = None
        self.reject: Exception | None = None
        self.fail_on_load: int | None = None
        """Raise a RuntimeError (as engines do) in this ``load`` call (0-based)."""
        self.collector_on: list[bool] = []
        """Whether Python's garbage collector was on, per ``load`` call."""
        self.chunks: list[tuple[str, int]] = []
        """The chunks written in place (a target with ``chunks_in_place``)."""

    def validate(self, manifest: VersionManifest) -> None:
        self.calls.append("validate")
        if self.reject is not None:
            raise self.reject

    def begin(self, manifest: VersionManifest) -> None:
        self.calls.append("begin")

    def load(self, arrival: Arrival) -> torch.Tensor | None:
        self.collector_on.append(gc.isenabled())
        for tensors, _ in arrival.whole():
            if len(self.loaded) == self.fail_on_load:
                raise RuntimeError("CUDA error: out of memory")
            self.loaded.append([name for name, _ in tensors])
            for name, tensor in tensors:
                self.live[name].copy_(tensor)
        for entry, data in arrival.chunks:
            self.chunks.append((entry.name, entry.chunk_index))
            live = byte_view(self.live[entry.name])
            live[entry.tensor_offset : entry.tensor_offset + entry.nbytes].copy_(data)
        return None

    def commit(self, manifest: VersionManifest) -> None:
        self.calls.append("commit")

    def abort(self, manifest: VersionManifest, error: WeightSyncError) -> None:
        self.calls.append("abort")
        self.aborted = error


class InPlace(Recorder):
    chunks_in_place = True


class Staged:
    """A version packed into shm staging buffers, one per bucket, as the sender packs it."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], version: int, part: VersionPartSpec | None = None
    ) -> None:
        self.tensors, self.version = tensors, version
        self.manifest = VersionManifest(
            version, tuple(TensorSpec.of(n, t) for n, t in tensors.items()), part=part
        )
        self.plan: BucketPlan = plan_buckets(self.manifest.tensors, CAP)
        self.buffers: list[StagingBuffer] = []
        for bucket in self.plan.buckets:
            staging = get_transport("shm").allocate(CAP, CPU)
            self.buffers.append(staging)
            for entry in bucket.entries:
                pack_entry(staging.tensor, entry, tensors[entry.name])
        sizes = [b.nbytes for b in self.plan.buckets]
        sums = [row_sums(s.tensor, n) for s, n in zip(self.buffers, sizes, strict=True)]
        self.checksums = finish_all(sums, sizes)

    def start(self) -> pb.Announcement:
        return pb.Announcement(
            start=pb.VersionStart(
                manifest=manifest_to_pb(self.manifest), num_buckets=len(self.plan.buckets)
            )
        )

    def bucket(self, index: int) -> pb.Announcement:
        return pb.Announcement(bucket=self.bucket_msg(index))

    def bucket_msg(self, index: int, buffer: StagingBuffer | None = None) -> pb.BucketAnnouncement:
        return pb.BucketAnnouncement(
            version=self.version,
            layout=bucket_to_pb(self.plan.buckets[index]),
            buffer=(buffer or self.buffers[index]).handle,
        )

    def end_msg(self) -> pb.VersionEnd:
        return pb.VersionEnd(
            version=self.version, checksum_algorithm=ALGORITHM, checksums=self.checksums
        )

    def announcements(self) -> list[pb.Announcement]:
        buckets = [self.bucket(i) for i in range(len(self.plan.buckets))]
        return [self.start(), *buckets, pb.Announcement(end=self.end_msg())]

    def release(self) -> None:
        for staging in self.buffers:
            get_transport("shm").release(staging)


@pytest.fixture
def stage() -> Iterator:
    made: list[Staged] = []

    def make(
        tensors: dict[str, torch.Tensor], version: int = 1, part: VersionPartSpec | None = None
    ) -> Staged:
        made.append(Staged(tensors, version, part))
        return made[-1]

    yield make
    for staged in made:
        staged.release()


def zeros_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in tensors.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


# -- the bucket reader ------------------------------------------------------------------------


def read_all(reader: BucketReader, target: Recorder, staged: Staged) -> VersionReads:
    reads = VersionReads(staged.version)
    for i in range(len(staged.plan.buckets)):
        msg = staged.bucket_msg(i)
        load = reader.prepare(msg, reads, None)
        load.write(target)
        assert reader.release(msg, load, reads) == (b"", None)  # CPU buffers: no wait
    return reads


def test_views_of_a_staging_buffer_see_its_current_bytes_and_no_other_buffers(stage):
    first, second = stage(weights(1)), stage(weights(2))
    reader = BucketReader(CPU, chunks_in_place=False, verify_checksums=False)
    tensors = dict(reader.prepare(first.bucket_msg(0), VersionReads(1), None).tensors)
    assert same(tensors, {n: first.tensors[n] for n in tensors}) and "a" in tensors
    # The same layout in another buffer: its own bytes, not the first buffer's views.
    other = dict(
        reader.prepare(first.bucket_msg(0, second.buffers[0]), VersionReads(1), None).tensors
    )
    assert same(other, {n: second.tensors[n] for n in other})
    # The next version packed into the first buffer: the views read the new bytes.
    for entry in first.plan.buckets[0].entries:
        pack_entry(first.buffers[0].tensor, entry, second.tensors[entry.name])
    again = dict(reader.prepare(first.bucket_msg(0), VersionReads(2), None).tensors)
    assert same(again, {n: second.tensors[n] for n in again})


def test_chunked_tensors_are_reassembled_and_loaded_with_their_last_bucket(stage):
    staged = stage(weights(1))
    target = Recorder(zeros_like(staged.tensors))
    reader = BucketReader(CPU, chunks_in_place=False, verify_checksums=False)
    reads = VersionReads(1)
    last_of_big = max(
        b.index for b in staged.plan.buckets if any(e.name == "big" for e in b.entries)
    )
    for i in range(last_of_big):
        msg = staged.bucket_msg(i)
        reader.prepare(msg, reads, None).write(target)
    with pytest.raises(ProtocolError, match="version 1 ended with chunks missing for 'big'"):
        reads.require_complete()
    read_all(reader, target, staged)
    assert same(target.live, staged.tensors)
    assert sum(names.count("big") for names in target.loaded) == 1


def test_a_target_writing_chunks_in_place_gets_each_chunk_and_never_the_whole_tensor(stage):
    staged = stage(weights(1))
    target = InPlace(zeros_like(staged.tensors))
    read_all(BucketReader(CPU, chunks_in_place=True, verify_checksums=False), target, staged)
    assert target.chunks == [("big", 0), ("big", 1), ("big", 2)]
    assert all("big" not in names for names in target.loaded)
    assert same(target.live, staged.tensors)


def test_checksums_match_for_intact_buckets(stage):
    staged = stage(weights(1))
    reader = BucketReader(CPU, chunks_in_place=False, verify_checksums=True)
    reads = read_all(reader, Recorder(zeros_like(staged.tensors)), staged)
    reads.check(staged.end_msg())


class Summing(InPlace):
    """Says the checksum its loads took of each bucket, as the GPU's one launch does: here the
    bucket's as it was when first read (``bucket_sums``); None says nothing was taken."""

    def __init__(self, live: dict[str, torch.Tensor], bucket_sums: dict[int, torch.Tensor]):
        super().__init__(live)
        self.bucket_sums = bucket_sums
        self.summed: list[int] = []

    def load(self, arrival: Arrival) -> torch.Tensor | None:
        assert super().load(arrival) is None
        if arrival.bucket is None:
            return None
        self.summed.append(arrival.nbytes)
        return self.bucket_sums.get(arrival.bucket.data_ptr())


def test_the_checksum_a_targets_loads_took_stands_in_for_a_second_read_of_the_bucket(stage):
    staged = stage(weights(1))
    took = {s.tensor.data_ptr(): row_sums(s.tensor, b.nbytes)
            for s, b in zip(staged.buffers, staged.plan.buckets, strict=True)}  # fmt: skip
    staged.buffers[1].tensor[staged.plan.buckets[1].entries[0].offset] ^= 0x40  # after
    for bucket_sums, fails in ((took, False), ({}, True)):
        target = Summing(zeros_like(staged.tensors), bucket_sums)
        reader = BucketReader(CPU, chunks_in_place=True, verify_checksums=True)
        reads = read_all(reader, target, staged)
        assert target.summed == [b.nbytes for b in staged.plan.buckets]  # chunks included
        if fails:  # nothing taken: the reader read each bucket again, and saw the flip
            with pytest.raises(ChecksumError, match="bucket 1 of version 1"):
                reads.check(staged.end_msg())
        else:
            reads.check(staged.end_msg())


def test_a_checksum_mismatch_names_the_bucket_and_its_first_tensor(stage):
    staged = stage(weights(1), version=3)
    corrupt = staged.plan.buckets[1]
    staged.buffers[1].tensor[corrupt.entries[0].offset] ^= 0x40  # after the sender's checksum
    reader = BucketReader(CPU, chunks_in_place=False, verify_checksums=True)
    reads = read_all(reader, Recorder(zeros_like(staged.tensors)), staged)
    first = corrupt.entries[0].name
    with pytest.raises(ChecksumError, match=f"bucket 1 of version 3 \\(first tensor '{first}'"):
        reads.check(staged.end_msg())
    unknown = pb.VersionEnd(version=3, checksum_algorithm="crc-0", checksums=staged.checksums)
    with pytest.raises(ChecksumError, match="unknown checksum algorithm 'crc-0'"):
        reads.check(unknown)


# -- the version state machine ----------------------------------------------------------------


def core_for(target: Recorder) -> tuple[ReceiverCore, MemoryConnection]:
    connection = MemoryConnection()
    return ReceiverCore(target, "memory:", connection=connection), connection


def test_a_version_is_validated_loaded_acked_committed_and_applied(stage):
    staged = stage(weights(1), version=4)
    target = Recorder(zeros_like(staged.tensors))
    core, connection = core_for(target)
    leftover = stage(weights(9), version=3).bucket(0)  # of a version this receiver left
    connection.announce(leftover, *staged.announcements())
    assert core.sync(timeout=5) == 4
    assert same(target.live, staged.tensors)
    assert target.calls == ["validate", "begin", "commit"]
    n = len(staged.plan.buckets)
    assert connection.kinds() == ["verdict"] + ["ack"] * n + ["applied"]
    verdict, applied = connection.sent[0].verdict, connection.sent[-1].applied
    assert (verdict.version, verdict.accepted) == (4, True)
    assert [m.ack.index for m in connection.sent[1:-1]] == list(range(n))
    assert (applied.version, applied.ok) == (4, True)
    assert (core.applied_version, core.dirty, core.last_error) == (4, False, None)


def folding_core(target: Recorder) -> tuple[ReceiverCore, MemoryConnection]:
    """A core on a connection whose sender's welcome said ``acks_in_applied``."""
    core, connection = core_for(target)
    connection.kept = KeptByStream(acks_in_applied=True)
    return core, connection


def test_the_last_ack_goes_with_applied_when_the_end_is_in_hand_and_the_sender_takes_it(stage):
    staged = stage(weights(1), version=4)
    target = Recorder(zeros_like(staged.tensors))
    core, connection = folding_core(target)
    connection.announce(*staged.announcements())
    assert core.sync(timeout=5) == 4
    assert same(target.live, staged.tensors)
    n = len(staged.plan.buckets)
    assert connection.kinds() == ["verdict"] + ["ack"] * (n - 1) + ["applied"]
    assert [m.ack.index for m in connection.sent[1:-1]] == list(range(n - 1))
    applied = connection.sent[-1].applied
    assert (applied.version, applied.ok) == (4, True)
    assert [(a.version, a.index, a.ok) for a in applied.acks] == [(4, n - 1, True)]


def test_the_last_ack_goes_alone_when_the_end_has_not_arrived(stage):
    staged = stage(weights(1), version=4)
    target = Recorder(zeros_like(staged.tensors))
    core, connection = folding_core(target)
    *announcements, end = staged.announcements()
    connection.announce(*announcements)
    n = len(staged.plan.buckets)
    with ThreadPoolExecutor(1) as pool:
        synced = pool.submit(core.sync, 10)
        try:  # the end comes only once the last ack went
            wait_until(lambda: connection.kinds().count("ack") == n, 10, f"{n} acks sent")
        finally:
            connection.announce(end)
        assert synced.result(timeout=10) == 4
    assert connection.kinds() == ["verdict"] + ["ack"] * n + ["applied"]
    assert list(connection.sent[-1].applied.acks) == []


def test_an_ack_whose_reads_are_still_queued_goes_at_once():
    """A CUDA slot's reads queued behind a ``read_event`` free it by that event: its ack is
    not held for the commit (the sender may repack the slot for the next version sooner)."""
    connection = MemoryConnection()
    connection.kept = KeptByStream(acks_in_applied=True)
    link = SimpleNamespace(connection=connection)
    end = pb.Announcement(end=pb.VersionEnd(version=4))
    queued = pb.BucketAck(version=4, index=2, ok=True, read_event=b"handle")
    assert ack_or_fold(link, queued, end) is None
    done = pb.BucketAck(version=4, index=2, ok=True)
    assert ack_or_fold(link, done, end) is done
    assert [m.ack for m in connection.sent] == [queued]


def test_the_ack_of_reads_of_another_gpus_buffer_waits_for_them_and_the_next_launch():
    """A staging buffer on another GPU is reused once acked, so its ack waits for the reads;
    when the next bucket comes while they run, the ack is held until that bucket's copies
    are queued too (the GPU gets them without a gap)."""
    connection = MemoryConnection()
    connection.kept = KeptByStream(acks_in_applied=True)
    acks = HeldAcks(SimpleNamespace(connection=connection))
    waited: list[tuple[int, int]] = []  # (bucket, acks sent when its reads were waited for)
    nxt = pb.Announcement(bucket=pb.BucketAnnouncement(version=4))
    end = pb.Announcement(end=pb.VersionEnd(version=4))

    class Reads:
        def __init__(self, index: int, arrives: pb.Announcement | SenderLost | None = None):
            self.index, self.arrives = index, arrives

        def done(self) -> bool:  # the next announcement comes while the reads run
            if self.arrives is None:
                return True
            connection.announce(self.arrives)
            self.arrives = None
            return False

        def wait(self) -> None:
            waited.append((self.index, len(connection.sent)))

    def ack(index: int) -> pb.BucketAck:
        return pb.BucketAck(version=4, index=index, ok=True)

    def sent() -> list[int]:
        return [m.ack.index for m in connection.sent]

    connection.announce(nxt)
    assert acks.after(ack(0), Reads(0), "w") == (None, nxt)  # bucket 1 is here: 0 is held
    assert (waited, sent()) == ([], [])
    assert acks.after(ack(1), Reads(1, arrives=nxt), "w") == (None, nxt)  # came while read
    assert (waited, sent()) == ([(0, 0)], [0])  # 1 launched: 0 went once read
    last = ack(2)
    connection.announce(end)
    assert acks.after(last, Reads(2), "w") == (last, end)  # 2 goes with the applied
    assert (waited, sent()) == ([(0, 0), (1, 1), (2, 2)], [0, 1])
    assert acks.after(ack(3), Reads(3), "w") == (None, None)  # read, nothing here: sent
    assert (waited[-1], sent()) == ((3, 2), [0, 1, 3])
    connection.announce(nxt)
    assert acks.after(ack(4), None, "w") == (None, nxt)  # no reads left running: sent
    connection.announce(nxt)
    assert acks.after(ack(5), Reads(5), "w") == (None, nxt)
    acks.abandon(send=False)  # a failure: the reads end before the rollback, no ack
    assert (waited[-1], sent()) == ((5, 4), [0, 1, 3, 4])
    lost = SenderLost("connection reset")  # while the reads run, looking for the next
    with pytest.raises(TransportError, match="connection reset"):
        acks.after(ack(6), Reads(6, arrives=lost), "w")
    acks.abandon(send=False)  # the failure's path: the reads it left running end first
    assert (waited[-1], sent()) == ((6, 4), [0, 1, 3, 4])


def test_a_failed_versions_held_reads_that_cannot_be_waited_for_leave_the_failure_to_report(
    caplog,
):
    """A GPU in error fails the wait too: the version's own failure must still reach the
    sender and the caller, so abandoning the held ack raises nothing (and logs the wait's)."""
    connection = MemoryConnection()
    acks = HeldAcks(SimpleNamespace(connection=connection))

    class Broken:
        def done(self) -> bool:
            return False

        def wait(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    connection.announce(pb.Announcement(bucket=pb.BucketAnnouncement(version=4)))
    assert acks.after(pb.BucketAck(version=4, index=0, ok=True), Broken(), "w")[0] is None
    acks.abandon(send=True)
    assert connection.sent == []
    assert "illegal memory access" in caplog.text


def test_a_held_ack_goes_before_the_failure_when_the_version_fails_at_its_end(stage):
    staged = stage(weights(1), version=4)
    n = len(staged.plan.buckets)
    staged.buffers[n - 1].tensor[staged.plan.buckets[n - 1].entries[0].offset] ^= 0x40
    target = Recorder(zeros_like(staged.tensors))
    core, connection = folding_core(target)
    connection.announce(*staged.announcements())
    with pytest.raises(ChecksumError, match=f"bucket {n - 1} of version 4"):
        core.sync(timeout=5)
    assert connection.kinds() == ["verdict"] + ["ack"] * n + ["applied"]
    assert connection.sent[-2].ack.index == n - 1
    applied = connection.sent[-1].applied
    assert (applied.ok, list(applied.acks)) == (False, [])
    assert core.dirty


def test_an_unchanged_manifest_is_validated_again_only_for_a_new_target_generation(stage):
    target = Recorder(zeros_like(weights(1)))
    core, connection = core_for(target)
    for version in (1, 2, 3):
        if version == 3:
            target.generation += 1  # e.g. vLLM switched to its draft model
        connection.announce(*stage(weights(version), version).announcements())
        assert core.sync(timeout=5) == version
    assert target.calls.count("validate") == 2


def test_a_rejected_manifest_is_answered_and_nothing_is_loaded(stage):
    staged = stage(weights(1))
    target = Recorder(zeros_like(staged.tensors))
    target.reject = ManifestMismatchError("tensor 'a' is (4, 8) but the module holds (8, 4)")
    core, connection = core_for(target)
    connection.announce(*staged.announcements())
    with pytest.raises(ManifestMismatchError, match="'a' is"):
        core.sync(timeout=5)
    assert connection.kinds() == ["verdict"]
    verdict = connection.sent[0].verdict
    assert not verdict.accepted and verdict.error.code == "ManifestMismatchError"
    assert target.calls == ["validate"] and target.loaded == []
    assert core.last_error is target.reject and not core.dirty


def test_an_engine_exception_in_validate_is_wrapped_saying_where(stage):
    target = Recorder(zeros_like(weights(1)))
    target.reject = KeyError("lm_head.weight")
    core, connection = core_for(target)
    connection.announce(*stage(weights(1), version=2).announcements())
    with pytest.raises(WeightSyncError, match="validating version 2: KeyError") as caught:
        core.sync(timeout=5)
    assert caught.value.__cause__ is target.reject
    assert connection.sent[0].verdict.error.message == str(caught.value)


def test_a_target_whose_keeps_raises_refuses_the_version_in_its_verdict(stage):
    """``keeps()`` is the engine's code too: its exception is answered in the verdict at once
    (it had left the sender waiting out its ack timeout for a verdict that never came)."""
    target = Recorder(zeros_like(weights(1)))
    target.keeps = lambda: {}["model.layers.0.mlp"]
    core, connection = core_for(target)
    connection.announce(*stage(weights(1), version=3).announcements())
    with pytest.raises(WeightSyncError) as caught:
        core.sync(timeout=5)
    assert str(caught.value) == "validating version 3: KeyError: 'model.layers.0.mlp'"
    assert isinstance(caught.value.__cause__, KeyError)
    assert connection.kinds() == ["verdict"]
    verdict = connection.sent[0].verdict
    assert not verdict.accepted and verdict.error.message == str(caught.value)
    assert target.loaded == []


@pytest.mark.parametrize("buckets_before_abort", [0, 1])
def test_the_senders_abort_fails_the_version_and_dirty_says_whether_weights_changed(
    stage, buckets_before_abort
):
    staged = stage(weights(1))
    target = Recorder(zeros_like(staged.tensors))
    core, connection = core_for(target)
    reason = pb.ErrorDetail(code="SyncTimeoutError", message="no ack from memory in 30 s")
    connection.announce(
        staged.start(),
        *[staged.bucket(i) for i in range(buckets_before_abort)],
        pb.Announcement(abort=pb.VersionAbort(version=1, reason=reason)),
    )
    with pytest.raises(ReceiverFailedError, match="abandoned version 1.*no ack from memory"):
        core.sync(timeout=5)
    assert target.calls[-1] == "abort" and target.aborted is core.last_error
    assert core.dirty == (buckets_before_abort > 0)
    assert "applied" not in connection.kinds()  # the sender knows already
    assert core.applied_version == 0


def test_an_engine_exception_mid_version_is_reported_at_once_naming_the_bucket(stage):
    staged = stage(weights(1))
    target = Recorder(zeros_like(staged.tensors))
    target.fail_on_load = 1
    core, connection = core_for(target)
    connection.announce(*staged.announcements())
    with pytest.raises(WeightSyncError, match="version 1, bucket 1: RuntimeError: CUDA error") as e:
        core.sync(timeout=5)
    assert isinstance(e.value.__cause__, RuntimeError)
    assert connection.kinds() == ["verdict", "ack", "applied"]
    applied = connection.sent[-1].applied
    assert (applied.version, applied.ok) == (1, False)
    assert "bucket 1" in applied.error.message
    assert core.dirty and target.aborted is e.value and "commit" not in target.calls


def test_a_corrupt_bucket_fails_the_version_before_commit(stage):
    staged = stage(weights(1))
    staged.buffers[0].tensor[0] ^= 1
    target = Recorder(zeros_like(staged.tensors))
    core, connection = core_for(target)
    connection.announce(*staged.announcements())
    with pytest.raises(ChecksumError, match="bucket 0 of version 1"):
        core.sync(timeout=5)
    assert connection.sent[-1].applied.error.code == "ChecksumError"
    assert core.dirty and "commit" not in target.calls


def test_losing_the_sender_fails_a_version_in_flight_but_not_the_wait_for_one(stage):
    first, second = stage(weights(1), 1), stage(weights(2), 2)
    target = Recorder(zeros_like(first.tensors))
    core, connection = core_for(target)
    connection.announce(first.start(), first.bucket(0), SenderLost("connection reset"))
    with pytest.raises(TransportError, match="lost the sender at memory: during a version"):
        core.sync(timeout=5)
    assert core.dirty and target.calls[-1] == "abort"
    connection.announce(SenderLost("still gone"))
    with pytest.raises(SyncTimeoutError, match="no version in time \\(the sender at memory: is"):
        core.sync(timeout=0.05)
    connection.announce(SenderLost("still gone"), *second.announcements())
    assert core.sync(timeout=5) == 2 and not core.dirty
    assert same(target.live, second.tensors)


def test_a_second_start_inside_a_version_is_a_protocol_error(stage):
    staged = stage(weights(1))
    core, connection = core_for(Recorder(zeros_like(staged.tensors)))
    connection.announce(staged.start(), staged.start())
    with pytest.raises(ProtocolError, match="unexpected start inside version 1"):
        core.sync(timeout=5)
    assert connection.sent[-1].applied.error.code == "ProtocolError"


# -- a version split over several senders -----------------------------------------------------

SPLIT = ({"a", "big"}, {"b", "c"})
"""Which of ``weights``' tensors each of two senders sends."""


def split(stage, seed: int, version: int) -> list[Staged]:
    """``weights(seed)`` as ``version``, staged as the two parts ``SPLIT`` says."""
    tensors = weights(seed)
    parts = [{n: t for n, t in tensors.items() if n in names} for names in SPLIT]
    specs = [tuple(TensorSpec.of(n, t) for n, t in p.items()) for p in parts]
    digest = plan_digest(specs)
    return [
        stage(p, version, VersionPartSpec(i, 2, f"trainer-{'ab'[i]}", digest, len(tensors)))
        for i, p in enumerate(parts)
    ]


def split_core(target: Recorder, **kwargs) -> tuple[ReceiverCore, list[MemoryConnection]]:
    connections = [MemoryConnection(), MemoryConnection()]
    for connection, address in zip(connections, ("memory:a", "memory:b"), strict=True):
        connection.inbox = Inbox(connection.receiver_id, address)
    core = ReceiverCore(target, ["memory:a", "memory:b"], connection=connections, **kwargs)
    return core, connections


def split_announced(
    target: Recorder, parts: list[Staged]
) -> tuple[ReceiverCore, list[MemoryConnection]]:
    """:func:`split_core` with each sender's part of ``parts`` announced."""
    core, connections = split_core(target)
    for staged, connection in zip(parts, connections, strict=True):
        connection.announce(*staged.announcements())
    return core, connections


def test_the_parts_of_a_split_version_are_validated_together_and_committed_once(stage):
    parts = split(stage, 1, 5)
    target = InPlace(zeros_like(weights(1)))
    core, connections = split_announced(target, parts)
    assert core.sync(timeout=5) == 5
    assert same(target.live, weights(1))
    assert target.calls == ["validate", "begin", "commit"]
    for staged, connection in zip(parts, connections, strict=True):
        n = len(staged.plan.buckets)
        assert connection.kinds() == ["verdict"] + ["ack"] * n + ["applied"]
        assert connection.sent[-1].applied.ok and connection.sent[0].verdict.accepted
    assert (core.applied_version, core.dirty) == (5, False)


def test_the_collector_is_paused_while_a_split_versions_parts_load_and_back_after(stage):
    parts = split(stage, 1, 5)
    target = Recorder(zeros_like(weights(1)))
    core, connections = split_announced(target, parts)
    assert gc.isenabled()
    assert core.sync(timeout=5) == 5
    assert target.collector_on and not any(target.collector_on)
    assert gc.isenabled()


def test_a_part_that_does_not_fit_the_model_fails_the_version_before_any_write(stage):
    parts = split(stage, 1, 5)
    target = Recorder(zeros_like(weights(1)))
    target.reject = ManifestMismatchError("tensor 'c' is (8,) int64 but the model holds (9,)")
    core, connections = split_announced(target, parts)
    with pytest.raises(ManifestMismatchError, match="'c' is"):
        core.sync(timeout=5)
    assert target.calls == ["validate"] and target.loaded == []
    for connection in connections:
        assert connection.kinds() == ["verdict"] and not connection.sent[0].verdict.accepted


def test_a_lost_sender_fails_the_version_naming_it_and_the_others_hear_it(stage):
    first, second = split(stage, 1, 5), split(stage, 2, 6)
    target = Recorder(zeros_like(weights(0)))
    core, (a, b) = split_core(target)
    a.announce(first[0].start(), first[0].bucket(0), SenderLost("connection reset"))
    b.announce(*first[1].announcements())
    with pytest.raises(TransportError) as e:
        core.sync(timeout=5)
    assert str(e.value).startswith(
        "version 5 failed on receiver memory: part 0 of 2 from sender trainer-a at memory:a, "
        "after its bucket 0: receiver memory: lost the sender at memory:a during a version"
    )
    assert str(e.value).endswith("the next version every sender sends heals them")
    assert "commit" not in target.calls and target.calls[-1] == "abort"
    assert core.dirty and core.applied_version == 0
    told = b.sent[-1].applied
    assert (told.version, told.ok, told.error.code) == (5, False, "TransportError")
    assert "trainer-a at memory:a" in told.error.message
    # The next version every sender sends heals it.
    for staged, connection in zip(second, (a, b), strict=True):
        connection.announce(*staged.announcements())
    assert core.sync(timeout=5) == 6 and not core.dirty
    assert same(target.live, weights(2))


def test_a_corrupt_bucket_in_one_part_fails_the_version_for_every_sender(stage):
    parts = split(stage, 1, 5)
    parts[1].buffers[0].tensor[0] ^= 1
    target = Recorder(zeros_like(weights(1)))
    core, connections = split_announced(target, parts)
    with pytest.raises(
        ChecksumError,
        match="part 1 of 2 from sender trainer-b at memory:b, after its bucket 0: bucket 0 ",
    ):
        core.sync(timeout=5)
    assert "commit" not in target.calls and core.dirty
    for connection in connections:
        applied = connection.sent[-1].applied
        assert (applied.ok, applied.error.code) == (False, "ChecksumError")


def test_a_part_that_never_starts_fails_the_version_and_is_declined_when_it_comes(stage):
    first, second = split(stage, 1, 5), split(stage, 2, 6)
    target = Recorder(zeros_like(weights(0)))
    core, (a, b) = split_core(target, part_timeout_s=0.3)
    a.announce(*first[0].announcements())
    with pytest.raises(SyncTimeoutError) as e:
        core.sync(timeout=5)
    assert str(e.value) == (
        "version 5: the part from the sender at memory:b did not start within 0.3 s of the "
        "parts from memory:a; the version fails on receiver memory before any write"
    )
    assert target.calls == [] and a.kinds() == ["verdict"]
    assert not a.sent[0].verdict.accepted
    # The late part is declined when it comes; the next version applies.
    b.announce(*first[1].announcements(), *second[1].announcements())
    a.announce(*second[0].announcements())
    assert core.sync(timeout=5) == 6
    assert same(target.live, weights(2))
    late = b.sent[0].verdict
    assert (late.version, late.accepted, late.error.code) == (5, False, "SyncTimeoutError")


def test_a_receiver_of_one_sender_refuses_a_part_before_any_write(stage):
    part = split(stage, 1, 5)[0]
    target = Recorder(zeros_like(weights(1)))
    core, connection = core_for(target)
    connection.announce(*part.announcements())
    with pytest.raises(PlanError) as e:
        core.sync(timeout=5)
    assert str(e.value) == (
        "version 5 is split over 2 senders (this one: trainer-a at memory:); register the "
        "receiver with every sender's address"
    )
    assert target.calls == [] and connection.kinds() == ["verdict"]
    assert connection.sent[0].verdict.error.code == "PlanError"


def test_a_box_lands_in_a_tensor_of_the_manifests_shape_and_one_that_does_not_fit_is_refused():
    """A slice bucket's entry is a box of its tensor: by default the target is handed a tensor
    of the manifest's shape holding the box where it belongs (the rest is never read)."""
    reads = VersionReads(3, [TensorSpec("w", "float32", (4, 6))])
    box = (
        plan_buckets([TensorSpec("w", "float32", (2, 3))], 1024, box_starts={"w": (1, 2)})
        .buckets[0]
        .entries[0]
    )
    data = torch.arange(6, dtype=torch.float32).view(2, 3)
    piece = reads.box(box, data)
    assert (piece.name, piece.shape, piece.start) == ("w", (4, 6), (1, 2))
    [[(name, full)]] = list(assembled([piece]))
    assert name == "w" and full.shape == (4, 6)
    assert torch.equal(full[1:3, 2:5], data)
    outside = (
        plan_buckets([TensorSpec("w", "float32", (2, 3))], 1024, box_starts={"w": (3, 2)})
        .buckets[0]
        .entries[0]
    )
    with pytest.raises(ProtocolError, match=r"version 3: a box at \[3, 2\] of shape \[2, 3\]"):
        reads.box(outside, data)
    # A negative start would slice from the end: refused, not written elsewhere.
    negative = (
        plan_buckets([TensorSpec("w", "float32", (2, 3))], 1024, box_starts={"w": (-1, 0)})
        .buckets[0]
        .entries[0]
    )
    with pytest.raises(ProtocolError, match=r"a box at \[-1, 0\] of shape \[2, 3\]"):
        reads.box(negative, data)
    unknown = (
        plan_buckets([TensorSpec("v", "float32", (2, 3))], 1024, box_starts={"v": (0, 0)})
        .buckets[0]
        .entries[0]
    )
    with pytest.raises(ProtocolError, match="does not fit 'v' \\(not in the version\\)"):
        reads.box(unknown, data)


def test_tensors_assembled_from_boxes_come_in_groups_of_bounded_size(monkeypatch):
    """A direct bucket of a sharded trainer's pieces holds the whole model: it is assembled
    and loaded a group at a time (about ASSEMBLE_BYTES each), every tensor whole and once."""
    monkeypatch.setattr(target_module, "ASSEMBLE_BYTES", 100)
    tensors = {f"w{i}": torch.arange(16.0) + i for i in range(3)}  # 64 bytes each
    boxes = [
        target_module.TensorBox(name, (16,), (start,), t[start : start + 8])
        for name, t in tensors.items()
        for start in (8, 0)
    ]
    groups = list(assembled(boxes))
    assert [[name for name, _ in g] for g in groups] == [["w0", "w1"], ["w2"]]
    assert all(torch.equal(full, tensors[name]) for g in groups for name, full in g)


class LiveTensors(InPlaceTarget):
    """Writes each tensor in place into ``live`` (the part ``keeps`` says, where it says one),
    recording the calls it gets."""

    def __init__(self, live: dict[str, torch.Tensor], keeps: dict[str, Box] | None = None):
        self.device, self.live, self.kept_boxes, self.calls = CPU, live, keeps or {}, []

    def validate(self, manifest: VersionManifest) -> None:
        self.calls.append("validate")

    def keeps(self) -> dict[str, Box]:
        return self.kept_boxes

    def live_tensor(self, name: str) -> torch.Tensor:
        return self.live[name]

    def load(self, arrival: Arrival) -> torch.Tensor | None:
        if arrival.boxes:
            self.calls.append(("boxes", arrival.key is not None, len(arrival.boxes)))
        return super().load(arrival)


@pytest.mark.parametrize("target_kind", ["whole tensors", "in place", "in place, one shard"])
def test_a_direct_bucket_of_a_sharded_trainers_pieces_loads_every_byte(target_kind):
    """A TP=2 trainer holds ``a`` as two column shards, ``b`` whole: the direct bucket reads
    ``a``'s two pieces in place. A plain target gets ``a`` assembled whole; an in-place one
    copies each piece straight into its part of the live tensor, the copies worked out once;
    one that keeps a shard (an engine TP rank) copies only what it keeps."""
    tensors = {"a": torch.randn(4, 8), "b": torch.randn(64)}
    specs = {n: TensorSpec.of(n, t) for n, t in tensors.items()}
    source = get_transport("shm").allocate(1024, CPU)  # both trainer ranks' memory
    pieces = [("a", 0, (0, 0)), ("a", 128, (0, 4)), ("b", 256, ())]
    located = [
        (TensorSpec("a", "float32", (4, 4)) if start else specs[name], 0, offset, start)
        for name, offset, start in pieces
    ]
    layout = bucket_to_pb(plan_direct(located, index=0, is_last=True))
    shard = Box((0, 4), (4, 4))
    live = {n: torch.zeros_like(t) for n, t in tensors.items()}
    if target_kind == "whole tensors":
        target = Recorder(live)
    elif target_kind == "in place":
        target = LiveTensors(live)
    else:
        live["a"] = torch.zeros(4, 4)
        target = LiveTensors(live, {"a": shard})
    core, connection = core_for(target)
    try:
        for version in (1, 2):
            for t in tensors.values():
                t.add_(version)
            for name, offset, start in pieces:
                piece = tensors[name] if not start else tensors[name][:, start[1] : start[1] + 4]
                data = byte_view(piece.contiguous())
                byte_view(source.tensor)[offset : offset + data.numel()].copy_(data)
            manifest = manifest_to_pb(VersionManifest(version, tuple(specs.values())))
            bucket = pb.BucketAnnouncement(version=version, layout=layout, sources=[source.handle])
            connection.announce(
                pb.Announcement(start=pb.VersionStart(manifest=manifest, num_buckets=0)),
                pb.Announcement(bucket=bucket),
                pb.Announcement(end=pb.VersionEnd(version=version)),
            )
            assert core.sync(timeout=5) == version
            want = dict(tensors)
            if target_kind == "in place, one shard":
                want["a"] = tensors["a"][:, 4:]
            assert same(target.live, want)
        if target_kind == "whole tensors":
            assert target.loaded == [["b"], ["a"]] * 2  # the views, then the assembled tensor
        else:
            assert target.calls == ["validate", ("boxes", True, 2), ("boxes", True, 2)]
            assert len(target._batches) == 2  # b's view and a's pieces: each worked out once
    finally:
        get_transport("shm").release(source)


def test_a_direct_bucket_announced_by_key_gets_its_layout_back_on_its_stream_only():
    """The sender sends a direct bucket's 339-entry layout once per stream, then its key
    alone (``ReceiverHello.layout_keys``); a key the stream never announced fails that
    version here with a ProtocolError abort instead of reading nothing."""
    layout = bucket_to_pb(plan_buckets([TensorSpec("w", "float32", (4,))], 1024).buckets[0])
    source = pb.BufferHandle(buffer_id="storage", nbytes=4096)
    full = pb.Announcement(
        bucket=pb.BucketAnnouncement(version=1, layout=layout, sources=[source], layout_key=b"k")
    )
    kept = KeptByStream()
    assert kept.complete(full) is full
    by_key = pb.Announcement(bucket=pb.BucketAnnouncement(version=2, layout_key=b"k"))
    assert kept.complete(by_key) is by_key  # nothing copied into it
    known = kept.bucket(by_key.bucket)
    assert (known.layout, list(known.sources)) == (layout, [source])
    unknown = KeptByStream().complete(
        pb.Announcement(bucket=pb.BucketAnnouncement(version=3, layout_key=b"k"))
    )
    assert unknown.WhichOneof("kind") == "abort" and unknown.abort.version == 3
    assert unknown.abort.reason.code == "ProtocolError"
    assert unknown.abort.reason.message.startswith(
        "version 3: a bucket came by layout_key 6b alone, but this stream holds nothing"
    )


def test_a_manifest_announced_by_key_gets_its_tensors_back_at_its_own_version():
    """A manifest the stream sent with its tensors once comes later as its key and version
    alone (``ReceiverHello.manifest_keys``); a start by a key the stream never sent is
    refused in the verdict at once, naming the key (it had been dropped as a stray abort,
    leaving the sender to time the receiver out)."""
    whole = manifest_to_pb(VersionManifest(1, (TensorSpec("w", "float32", (4,)),)))
    kept = KeptByStream()
    first = pb.Announcement(start=pb.VersionStart(manifest=whole, manifest_key=b"m"))
    assert kept.complete(first) is first
    again = kept.complete(
        pb.Announcement(start=pb.VersionStart(manifest=pb.Manifest(version=5), manifest_key=b"m"))
    )
    assert not again.start.manifest.tensors  # nothing copied into it
    manifest = kept.manifest(again.start)
    assert manifest.version == 5
    assert list(manifest.tensors) == list(whole.tensors)
    assert whole.version == 1  # the kept copy stays as it came
    target = Recorder({"w": torch.zeros(4)})
    core, connection = core_for(target)
    connection.announce(
        pb.Announcement(start=pb.VersionStart(manifest=pb.Manifest(version=6), manifest_key=b"m"))
    )
    why = "version 6: a start came by manifest_key 6d alone, but this stream holds nothing"
    with pytest.raises(ProtocolError, match=why):
        core.sync(timeout=5)
    (verdict,) = [m.verdict for m in connection.sent]
    assert (verdict.version, verdict.accepted) == (6, False)
    assert why in verdict.error.message
    assert target.calls == []


def test_a_direct_version_announced_by_keys_alone_reads_the_kept_layout_in_place():
    """From the second version the sender sends the manifest and the direct bucket by their
    keys alone: the core reads the layout and sources kept for the stream (nothing copied into
    the announcement), acks the bucket for the version being read and loads every byte."""
    tensors = {"a": torch.randn(4, 8), "b": torch.randn(64)}
    specs = tuple(TensorSpec.of(n, t) for n, t in tensors.items())
    source = get_transport("shm").allocate(1024, CPU)  # the trainer memory read in place
    offsets = {"a": 0, "b": 256}
    located = [(spec, 0, offsets[spec.name], ()) for spec in specs]
    layout = bucket_to_pb(plan_direct(located, index=0, is_last=True))
    target = Recorder({n: torch.zeros_like(t) for n, t in tensors.items()})
    core, connection = core_for(target)
    try:
        for version in (1, 2):
            for name, t in tensors.items():
                t.add_(version)
                byte_view(source.tensor)[offsets[name] : offsets[name] + t.nbytes].copy_(
                    byte_view(t)
                )
            start = pb.VersionStart(num_buckets=0, manifest_key=b"m")
            bucket = pb.BucketAnnouncement(version=version, layout_key=b"k")
            if version == 1:
                start.manifest.CopyFrom(manifest_to_pb(VersionManifest(version, specs)))
                bucket.layout.CopyFrom(layout)
                bucket.sources.append(source.handle)
            start.manifest.version = version
            connection.announce(
                pb.Announcement(start=start),
                pb.Announcement(bucket=bucket),
                pb.Announcement(end=pb.VersionEnd(version=version)),
            )
            assert core.sync(timeout=5) == version
            assert same(target.live, tensors)
            ack = connection.sent[-2].ack
            assert (ack.version, ack.index, ack.ok) == (version, 0, True)
    finally:
        get_transport("shm").release(source)


class Watching(Recorder):
    """Records what the receiver had sent when it began the version and at each load; may
    announce the rest of the version as it begins (``then``)."""

    def __init__(self, live: dict[str, torch.Tensor], connection: MemoryConnection) -> None:
        super().__init__(live)
        self.connection = connection
        self.then: list[pb.Announcement] = []
        self.sent_at: list[tuple[str, list[str]]] = []

    def begin(self, manifest: VersionManifest) -> None:
        super().begin(manifest)
        self.sent_at.append(("begin", self.connection.kinds()))
        self.connection.announce(*self.then)

    def load(self, arrival: Arrival) -> torch.Tensor | None:
        self.sent_at.append(("load", self.connection.kinds()))
        return super().load(arrival)


@pytest.mark.parametrize("in_hand", [True, False], ids=["bucket in hand", "bucket later"])
def test_the_verdict_goes_once_the_first_bucket_in_hand_is_launched_else_before_begin(
    stage, in_hand
):
    """A direct-only version's start, bucket and end come in one message: its copies start
    before the verdict is sent. Otherwise the verdict goes before anything else."""
    staged = stage(weights(1), version=2)
    first, *rest = staged.announcements()
    connection = MemoryConnection()
    target = Watching(zeros_like(staged.tensors), connection)
    core = ReceiverCore(target, "memory:", connection=connection)
    if in_hand:
        connection.announce(first, *rest)
    else:
        connection.announce(first)
        target.then = rest
    assert core.sync(timeout=5) == 2
    assert same(target.live, staged.tensors)
    n = len(staged.plan.buckets)
    assert connection.kinds() == ["verdict"] + ["ack"] * n + ["applied"]
    if in_hand:
        assert target.sent_at[:2] == [("begin", []), ("load", [])]
    else:
        assert target.sent_at[:2] == [("begin", ["verdict"]), ("load", ["verdict"])]


# -- the sender writing the weights (protocol §4.3) ---------------------------------------------


class Offering(Recorder):
    """A target that lets a sender write its weights (on the CPU here: only the protocol)."""

    def write_regions(self, manifest: VersionManifest) -> dict:
        return {s.name: [Region((0,) * len(s.shape), self.live[s.name])] for s in manifest.tensors}


def offering_core(takes_writes: bool) -> tuple[Offering, ReceiverCore, MemoryConnection]:
    target = Offering(zeros_like(weights(1)))
    core, connection = core_for(target)
    connection.kept = KeptByStream(takes_writes=takes_writes)
    return target, core, connection


def test_a_receiver_offers_its_weights_once_per_stream_and_begins_before_the_verdict(stage):
    staged = stage(weights(1))
    target, core, connection = offering_core(takes_writes=True)
    written = pb.Announcement(bucket=staged.bucket_msg(0))
    written.bucket.ClearField("buffer")
    written.bucket.written = True
    rest = [staged.bucket(i) for i in range(1, len(staged.plan.buckets))]
    connection.announce(staged.start(), written, *rest, pb.Announcement(end=staged.end_msg()))
    assert core.sync(timeout=5) == 1
    assert connection.kinds()[:2] == ["offer", "verdict"]
    offer, verdict = connection.sent[0].offer, connection.sent[1].verdict
    assert verdict.writes_key == offer.key != b""
    assert target.calls == ["validate", "begin", "commit"]
    # The written bucket was only acked: its tensors were not loaded here.
    first = {e.spec.name for e in staged.plan.buckets[0].entries}
    assert not first & {n for names in target.loaded for n in names}
    assert [m.ack.index for m in connection.sent if m.WhichOneof("kind") == "ack"][0] == 0
    # The next version names the offer by its key alone.
    again = stage(weights(2), version=2)
    connection.announce(*again.announcements())
    assert core.sync(timeout=5) == 2
    kinds = connection.kinds()
    assert kinds.count("offer") == 1
    assert connection.sent[kinds.index("verdict", 2)].verdict.writes_key == offer.key


def test_after_letting_the_sender_write_an_aborted_version_leaves_the_weights_dirty(stage):
    staged = stage(weights(1))
    _, core, connection = offering_core(takes_writes=True)
    reason = pb.ErrorDetail(code="ChecksumError", message="bucket 0 as the sender wrote it")
    connection.announce(
        staged.start(), pb.Announcement(abort=pb.VersionAbort(version=1, reason=reason))
    )
    with pytest.raises(ReceiverFailedError, match="as the sender wrote it"):
        core.sync(timeout=5)
    assert core.dirty  # no bucket came, but the sender may have written one


@pytest.mark.parametrize("takes_writes", [False, True], ids=["sender-takes-none", "not-offered"])
def test_a_bucket_written_into_weights_never_offered_fails_the_version(stage, takes_writes):
    staged = stage(weights(1))
    target, core, connection = offering_core(takes_writes)
    if takes_writes:
        target.write_regions = lambda manifest: None  # this target loads every bucket
    written = pb.Announcement(bucket=staged.bucket_msg(0))
    written.bucket.written = True
    connection.announce(staged.start(), written)
    with pytest.raises(ProtocolError, match="came as written into weights this receiver did not"):
        core.sync(timeout=5)
    assert "offer" not in connection.kinds()
    assert not connection.sent[0].verdict.writes_key
