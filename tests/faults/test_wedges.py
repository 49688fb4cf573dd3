"""Issue 16 item 5: a stalled, rogue or rejected version cannot wedge the pipeline.

Before, a publisher that stopped packing held the sender's one version driver for
``pack_timeout_s`` (600 s) even after every receiver had rejected its version, and every
version queued behind it waited as long. Now a version every receiver rejected ends at once,
a publisher that packs nothing for ``stall_timeout_s`` loses its version, one that packs
slowly loses it after ``pack_timeout_s`` of waiting in all, and one that gives up withdraws
it at once.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from tests.support import TinyNet, digests, step, sync_in_thread, wait_until
from tests.support.raw_streams import begin, raw_publisher, raw_receiver, status_within
from weightsync.errors import NameResolutionError, ReceiverFailedError, VersionError
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher, Sender
from weightsync.transports import get_transport
from weightsync.v1 import weightsync_pb2 as pb


def tiny_specs(trainer: TinyNet, extra: str = "") -> list[pb.TensorSpec]:
    specs = [
        pb.TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
        for n, t in trainer.state_dict().items()
    ]
    if extra:
        specs.append(pb.TensorSpec(name=extra, dtype="float32", shape=[4]))
    return specs


def two_receivers(address: str, syncs: int):
    models = [TinyNet(seed=10 + i) for i in range(2)]
    receivers = [TorchReceiver(m, address, receiver_id=f"r{i}") for i, m in enumerate(models)]
    threads = [sync_in_thread(r, n=syncs)[0] for r in receivers]
    return models, receivers, threads


def test_a_version_every_receiver_rejected_ends_at_once(sock_dir):
    """Its publisher never packs; the version ends as soon as both verdicts are in, and the
    next version does not wait for a timeout: both are an hour, the waits here a minute."""
    with Sender(
        f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024, stall_timeout_s=3600, pack_timeout_s=3600
    ) as sender:
        models, receivers, threads = two_receivers(sender.address, syncs=2)
        before = [digests(m) for m in models]
        trainer = TinyNet(seed=2)
        raw = raw_publisher(sender.address)
        raw.send(begin(1, tiny_specs(trainer, extra="ghost.weight")))
        wait_until(
            lambda: sender.coordinator.run_of(1) and sender.coordinator.run_of(1).done,
            60,
            "version 1 to end",
        )
        v1 = status_within(sender.address).versions[-1]
        assert v1.state == "failed" and not v1.HasField("abandoned")
        assert {o.receiver_id: o.error.code for o in v1.receivers} == {
            "r0": "NameResolutionError",
            "r1": "NameResolutionError",
        }
        assert [digests(m) for m in models] == before
        step(trainer, 2)
        publisher = Publisher(sender.address)
        result = publisher.publish(trainer.state_dict(), 2, wait=True, timeout_s=60)
        assert [o.state for o in result.status.receivers] == ["applied", "applied"]
        for model, thread in zip(models, threads, strict=True):
            first, second = thread.finish(10)
            assert isinstance(first, NameResolutionError) and second == 2
            assert digests(model) == digests(trainer)
        raw.close()
        for r in receivers:
            r.close()


def test_a_rejected_version_tells_a_waiting_publisher_at_once(sock_dir):
    """The publisher packs for itself (CPU tensors): it hears ``done`` with each receiver's
    rejection without packing the buckets nobody will read."""
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024) as sender:
        models, receivers, threads = two_receivers(sender.address, syncs=1)
        tensors = dict(TinyNet(seed=2).state_dict())
        tensors["ghost.weight"] = torch.zeros(4)
        # A publisher left waiting would raise SyncTimeoutError instead.
        with pytest.raises(ReceiverFailedError, match="r0: NameResolutionError.*ghost.weight"):
            Publisher(sender.address).publish(tensors, 1, wait=True, timeout_s=30)
        for thread in threads:
            assert isinstance(thread.finish(10)[0], NameResolutionError)
        for r in receivers:
            r.close()


def test_a_stalled_publisher_loses_its_version_after_the_stall_timeout(sock_dir):
    """The raw publisher begins version 1, which every receiver accepts, and never packs:
    the version is abandoned after stall_timeout_s (the message says so), and version 2,
    queued behind it, then applies."""
    stall = 2.0
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024, stall_timeout_s=stall) as s:
        models, receivers, threads = two_receivers(s.address, syncs=2)
        before = [digests(m) for m in models]
        trainer = TinyNet(seed=2)
        raw = raw_publisher(s.address)
        raw.send(begin(1, tiny_specs(trainer)))
        assert raw.first() == "welcome"
        assert next(raw.replies).WhichOneof("kind") == "pack"
        step(trainer, 2)
        result = Publisher(s.address).publish(trainer.state_dict(), 2, wait=True, timeout_s=30)
        assert [o.state for o in result.status.receivers] == ["applied", "applied"]
        kinds, _, details = raw.outcome()
        assert details == (
            "WeightSyncError: version 1 abandoned: version 1: the publishers packed nothing for "
            "2 s (stall_timeout_s, WEIGHTSYNC_STALL_TIMEOUT_S) while the sender waited for "
            "bucket 0 from rank(s) [0]"
        )
        v1 = status_within(s.address).versions[0]
        assert (v1.state, v1.abandoned.code) == ("failed", "SyncTimeoutError")
        for model, thread, old in zip(models, threads, before, strict=True):
            first, second = thread.finish(10)
            assert isinstance(first, ReceiverFailedError) and second == 2
            assert old != digests(model) == digests(trainer)
        raw.close()
        for r in receivers:
            r.close()


def test_a_publisher_that_packs_too_slowly_loses_its_version_after_the_pack_timeout(sock_dir):
    """Each bucket packed just within the stall timeout, but the version's packing takes
    longer than pack_timeout_s in all."""
    with Sender(
        f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024, stall_timeout_s=5, pack_timeout_s=1.5
    ) as s:
        raw = raw_publisher(s.address)
        raw.send(begin(1, [pb.TensorSpec(name="w", dtype="float32", shape=[4096])]))

        def pack_slowly(reply):
            if reply.WhichOneof("kind") == "pack":
                time.sleep(0.6)
                buffer = get_transport("shm").map(reply.pack.buffer)
                for e in reply.pack.layout.entries:  # written: the sender checks (stamps)
                    buffer[e.offset : e.offset + e.nbytes] = 0
                packed = pb.BucketPacked(version=1, index=reply.pack.layout.index)
                raw.send(pb.PublisherMessage(packed=packed))

        kinds, _, details = raw.outcome(pack_slowly)
        assert details.startswith(
            "WeightSyncError: version 1 abandoned: version 1: the publishers kept the sender "
            "waiting 1.5 s in all (pack_timeout_s, WEIGHTSYNC_PACK_TIMEOUT_S)"
        )
        raw.close()


def test_a_publisher_that_gives_up_withdraws_its_version_at_once(sock_dir):
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024) as s:
        models, receivers, threads = two_receivers(s.address, syncs=2)
        trainer = TinyNet(seed=2)
        raw = raw_publisher(s.address)
        raw.send(begin(1, tiny_specs(trainer)))
        assert raw.first() == "welcome"
        assert next(raw.replies).WhichOneof("kind") == "pack"
        raw.close()  # cancels the stream
        wait_until(lambda: s.coordinator.run_of(1).done, 30, "version 1 to be withdrawn")
        v1 = status_within(s.address).versions[0]
        assert v1.abandoned.message == "publisher rank 0 closed its stream"
        step(trainer, 2)
        result = Publisher(s.address).publish(trainer.state_dict(), 2, wait=True, timeout_s=30)
        assert [o.state for o in result.status.receivers] == ["applied", "applied"]
        for model, thread in zip(models, threads, strict=True):
            assert thread.finish(10)[1] == 2 and digests(model) == digests(trainer)
        for r in receivers:
            r.close()


def test_a_deaf_receiver_costs_one_ack_timeout_not_one_per_version(sock_dir):
    """It registers and never answers: it fails version 1 after ack_timeout_s and its stream
    is closed, so version 2 is not addressed to it and does not wait again."""
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024, ack_timeout_s=1.5) as s:
        deaf = raw_receiver(s.address, receiver_id="deaf")
        assert deaf.first() == "welcome"
        models, receivers, threads = two_receivers(s.address, syncs=2)
        trainer = TinyNet(seed=2)
        publisher = Publisher(s.address)
        with pytest.raises(ReceiverFailedError, match="deaf: SyncTimeoutError"):
            publisher.publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
        kinds, code, details = deaf.outcome()
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert details.startswith(
            "SyncTimeoutError: receiver deaf sent nothing for 2 s during version 1 (owed: "
        )
        assert details.endswith("verdict); its stream is closed: register again")
        step(trainer, 2)
        result = publisher.publish(trainer.state_dict(), 2, wait=True, timeout_s=30)
        # Not addressed to the deaf receiver, so nothing waits for its ack timeout again.
        assert [o.receiver_id for o in result.status.receivers] == ["r0", "r1"]
        for model, thread in zip(models, threads, strict=True):
            assert thread.finish(10) == [1, 2] and digests(model) == digests(trainer)
        deaf.close()
        publisher.close()
        for r in receivers:
            r.close()


def test_a_version_that_failed_leaving_no_trace_does_not_use_up_its_number(sock_dir):
    """Issue 35: one begin of version 2^63-1 that every receiver rejected blocked every later
    publish until the sender restarted. A version no receiver applied or was sent a byte of
    holds nothing back: version 2 publishes after it, and a failed version 3 may be published
    again. One that was applied still does (versions only increase)."""
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024) as s:
        models, receivers, threads = two_receivers(s.address, syncs=4)
        trainer = TinyNet(seed=2)
        raw = raw_publisher(s.address)
        raw.send(begin(2**63 - 1, tiny_specs(trainer, extra="ghost.weight")))
        assert raw.first() == "welcome"
        wait_until(
            lambda: s.coordinator.run_of(2**63 - 1) and s.coordinator.run_of(2**63 - 1).done,
            60,
            "the huge version to end",
        )
        raw.close()
        huge = status_within(s.address).versions[-1]
        assert (huge.version, huge.state) == (2**63 - 1, "failed")
        assert {o.error.code for o in huge.receivers} == {"NameResolutionError"}
        publisher = Publisher(s.address)
        step(trainer, 2)
        publisher.publish(trainer.state_dict(), 2, wait=True, timeout_s=30)
        bad = {**trainer.state_dict(), "ghost.weight": torch.zeros(4)}
        with pytest.raises(ReceiverFailedError, match="ghost.weight"):
            publisher.publish(bad, 3, wait=True, timeout_s=30)
        step(trainer, 3)
        result = publisher.publish(trainer.state_dict(), 3, wait=True, timeout_s=30)
        assert [o.state for o in result.status.receivers] == ["applied", "applied"]
        assert status_within(s.address).versions[-1].state == "complete"
        with pytest.raises(VersionError, match="not greater than the last published version 3"):
            publisher.publish(trainer.state_dict(), 3, timeout_s=30)
        for model, thread in zip(models, threads, strict=True):
            got = thread.finish(30)
            assert [type(x) if isinstance(x, Exception) else x for x in got] == [
                NameResolutionError,
                2,
                NameResolutionError,
                3,
            ]
            assert digests(model) == digests(trainer)
        publisher.close()
        for r in receivers:
            r.close()


def test_a_version_every_receiver_rejected_does_not_wait_for_its_publisher(sock_dir):
    """Issue 35 item 4: a version every receiver rejected ends at once, but its publisher, asked
    to pack, may still write into the staging slots; the next version waited for it (up to the
    stall timeout) before reusing them. Those slots are lent to it instead, so the next
    version, from another publisher, is applied while the first still holds them."""
    from tests.support.raw_streams import RawStream

    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024, stall_timeout_s=600) as s:
        models, receivers, threads = two_receivers(s.address, syncs=2)
        trainer = TinyNet(seed=2)
        first = pb.PublisherMessage(hello=pb.PublisherHello(publisher_id="raw", device="cpu"))
        raw = RawStream(s.address, "Publish", first, timeout_s=600)
        raw.send(begin(5, tiny_specs(trainer, extra="ghost.weight")))
        assert raw.first() == "welcome"
        publisher = Publisher(s.address)
        step(trainer, 6)
        result = publisher.publish(trainer.state_dict(), 6, wait=True, timeout_s=60)
        assert [o.state for o in result.status.receivers] == ["applied", "applied"]
        assert s.coordinator.run_of(5).done  # the raw publisher is still there, never packed
        raw.close()
        for model, thread in zip(models, threads, strict=True):
            got = thread.finish(30)
            assert [type(x) if isinstance(x, Exception) else x for x in got] == [
                NameResolutionError,
                6,
            ]
            assert digests(model) == digests(trainer)
        publisher.close()
        for r in receivers:
            r.close()
