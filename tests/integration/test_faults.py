"""Every bad input gives an error naming the tensor or field, and nothing half-applied."""

from __future__ import annotations

import glob
import os
import time

import grpc
import pytest
import torch

from tests.support import (
    TinyNet,
    digests,
    next_outcomes,
    start_receivers,
    step,
    sync_in_thread,
    wait_until,
)
from tests.support.processes import sender_process
from weightsync.errors import (
    ChecksumError,
    ConfigError,
    ManifestMismatchError,
    NameResolutionError,
    ReceiverFailedError,
    SyncTimeoutError,
    TransportError,
    VersionError,
    WeightSyncError,
)
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher
from weightsync.sender.daemon import Sender


def test_unknown_name_is_rejected_before_any_write(sender):
    model = TinyNet(seed=1)
    receiver = TorchReceiver(model, sender.address, receiver_id="r")
    before = digests(model)
    trainer = TinyNet(seed=2)
    tensors = dict(trainer.state_dict())
    tensors["layers.0.ghost.weight"] = torch.zeros(4)
    t, results = sync_in_thread(receiver)
    with pytest.raises(ReceiverFailedError, match="layers.0.ghost.weight"):
        Publisher(sender.address).publish(tensors, 1, wait=True, timeout_s=30)
    t.finish(30)
    assert isinstance(results[0], NameResolutionError)
    assert "'layers.0.ghost.weight'" in str(results[0])
    assert digests(model) == before
    (status,) = Publisher(sender.address).status().receivers
    assert (status.applied_version, status.state) == (0, "idle")
    assert "layers.0.ghost.weight" in status.last_error


def test_shape_or_dtype_mismatch_is_rejected_before_any_write(sender):
    model = TinyNet(seed=1)
    receiver = TorchReceiver(model, sender.address)
    before = digests(model)
    tensors = dict(TinyNet(seed=2).state_dict())
    tensors["norm"] = torch.zeros(17)
    t, results = sync_in_thread(receiver)
    with pytest.raises(ReceiverFailedError, match="'norm' is \\(17,\\)"):
        Publisher(sender.address).publish(tensors, 1, wait=True, timeout_s=30)
    t.finish(30)
    assert isinstance(results[0], ManifestMismatchError)
    assert digests(model) == before
    tensors["norm"] = torch.zeros(16, dtype=torch.float64)
    t, results = sync_in_thread(receiver)
    with pytest.raises(ReceiverFailedError, match="'norm' is \\(16,\\) float64"):
        Publisher(sender.address).publish(tensors, 2, wait=True, timeout_s=30)
    t.finish(30)
    assert digests(model) == before


def test_corrupted_bucket_is_rejected_marked_dirty_and_healed_by_republishing(sender, monkeypatch):
    import weightsync.sender.announcements as announcements

    model = TinyNet(seed=1)
    receiver = TorchReceiver(model, sender.address, receiver_id="r")
    trainer = TinyNet(seed=2)
    publisher = Publisher(sender.address)
    t, results = sync_in_thread(receiver, n=3)
    publisher.publish(trainer.state_dict(), 1, wait=True, timeout_s=30)

    real = announcements.finish_all

    def corrupt_second_bucket(sums, sizes):
        values = real(sums, sizes)
        values[1] ^= 1
        return values

    monkeypatch.setattr(announcements, "finish_all", corrupt_second_bucket)
    step(trainer, 2)
    with pytest.raises(ReceiverFailedError, match="bucket 1 of version 2 .* fails its checksum"):
        publisher.publish(trainer.state_dict(), 2, wait=True, timeout_s=30)
    monkeypatch.setattr(announcements, "finish_all", real)
    wait_until(lambda: len(results) >= 2, 10, "the receiver's sync of version 2 did not return")
    assert isinstance(results[1], ChecksumError)
    assert receiver.dirty and receiver.applied_version == 1
    (status,) = publisher.status().receivers
    assert (status.state, status.applied_version) == ("dirty", 1)

    step(trainer, 3)
    publisher.publish(trainer.state_dict(), 3, wait=True, timeout_s=30)
    t.finish(30)
    assert results[2] == 3 and not receiver.dirty
    assert digests(model) == digests(trainer)
    (status,) = publisher.status().receivers
    assert (status.state, status.applied_version) == ("idle", 3)


def test_receiver_dying_mid_version_fails_alone_and_others_complete(sender):
    procs, out = start_receivers(
        sender.address, ["alive", "doomed"], syncs=2, die_on_version={"doomed": 2}
    )
    trainer = TinyNet(seed=1)
    publisher = Publisher(sender.address)
    publisher.publish(trainer.state_dict(), 1, wait=True, timeout_s=60)
    step(trainer, 2)
    start = time.monotonic()
    with pytest.raises(ReceiverFailedError, match="doomed") as err:
        publisher.publish(trainer.state_dict(), 2, wait=True, timeout_s=60)
    assert "alive" not in str(err.value).split("failed on")[1]
    assert time.monotonic() - start < 15  # the stream break is seen at once, not at a timeout
    outcomes = {o.receiver_id: o.state for o in publisher.status().versions[-1].receivers}
    assert outcomes == {"alive": "applied", "doomed": "failed"}
    results = next_outcomes(out, 3, timeout=30)
    assert [(r[0], r[1], r[2]) for r in results if r[0] == "alive"] == [
        ("alive", "applied", 1),
        ("alive", "applied", 2),
    ]
    assert [r[3] for r in results if r[0] == "alive"][-1] == digests(trainer)
    procs[1].join(30)
    assert procs[1].exitcode == 3
    status = {r.receiver_id: r for r in publisher.status().receivers}
    assert not status["doomed"].connected and status["doomed"].applied_version == 1


def test_stalled_receiver_times_out_and_others_complete(sock_dir):
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=4096, ack_timeout_s=1.0) as s:
        # Held, never syncs (a dropped receiver would leave instead of stalling).
        stalled = TorchReceiver(TinyNet(seed=3), s.address, receiver_id="stalled")
        live = TinyNet(seed=4)
        receiver = TorchReceiver(live, s.address, receiver_id="live")
        t, results = sync_in_thread(receiver)
        trainer = TinyNet(seed=5)
        start = time.monotonic()
        with pytest.raises(
            ReceiverFailedError,
            match="stalled: SyncTimeoutError: receiver stalled sent nothing for 1 s",
        ):
            Publisher(s.address).publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
        assert time.monotonic() - start < 10
        t.finish(30)
        assert results == [1] and digests(live) == digests(trainer)
        stalled.close()


def test_version_must_increase(sender):
    publisher = Publisher(sender.address)
    publisher.publish({"w": torch.ones(4)}, 5)
    for bad in (5, 4):
        with pytest.raises(
            VersionError, match=f"version {bad} is not greater than the last published version 5"
        ):
            publisher.publish({"w": torch.ones(4)}, bad)
    publisher.publish({"w": torch.ones(4)}, 6)


def test_a_publish_stream_carries_every_version_and_reopens_after_a_failure(sender):
    """One Publish stream per publisher (a new stream per version cost about a millisecond of
    setup); a failed version drops it and the next publish opens another."""
    publisher = Publisher(sender.address)
    publisher.publish({"w": torch.ones(4)}, 1)
    stream = publisher._stream
    publisher.publish({"w": torch.ones(4)}, 2)
    assert publisher._stream is stream
    with pytest.raises(VersionError):
        publisher.publish({"w": torch.ones(4)}, 2)
    assert publisher._stream is None
    publisher.publish({"w": torch.ones(4)}, 3)
    assert publisher._stream is not None and publisher._stream is not stream
    assert publisher.status().versions[-1].version == 3


def test_the_timeout_is_per_version_on_a_kept_stream(sender):
    """A receiver that registered but never applies: ``wait=True`` gives up after this
    version's ``timeout_s``, not the stream's age."""
    publisher = Publisher(sender.address)
    publisher.publish({"w": torch.ones(4)}, 1)  # the stream is open from here on
    time.sleep(1.5)  # deliberately lets time pass: the stream is older than version 2's timeout
    idle = TorchReceiver(TinyNet(seed=1), sender.address, receiver_id="idle")
    start = time.monotonic()
    with pytest.raises(
        SyncTimeoutError, match="publish version 2 to .*: the version was not applied within 1 s"
    ):
        publisher.publish(TinyNet(seed=2).state_dict(), 2, wait=True, timeout_s=1)
    assert 0.9 < time.monotonic() - start < 10
    idle.close()


def test_unreachable_address_names_it(sock_dir):
    missing = f"unix:{sock_dir}/nobody.sock"
    with pytest.raises(TransportError, match=f"no weightsync sender answers at {missing}"):
        Publisher(missing, connect_timeout_s=0.5)
    with pytest.raises(TransportError, match="no weightsync sender answers"):
        TorchReceiver(TinyNet(), missing, connect_timeout_s=0.5)
    with pytest.raises(ConfigError, match="neither unix:/abs/path nor host:port"):
        Publisher("localhost")


def test_second_sender_on_the_same_address_is_refused(sender):
    with pytest.raises(ConfigError, match="already listens"):
        Sender(sender.address)
    # The first sender still serves.
    assert Publisher(sender.address).status().bucket_size_bytes == 4096
    with Sender("127.0.0.1:0") as tcp:
        with pytest.raises(ConfigError, match="cannot listen"):
            Sender(tcp.address)


def test_health_and_reflection_are_served(sender):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"unix:{sender.address[5:]}") as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="weightsync.v1.WeightSync"), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert "weightsync.v1.WeightSync" in names and "grpc.health.v1.Health" in names


def test_shm_buffers_are_owner_only(sender):
    receiver = TorchReceiver(TinyNet(seed=1), sender.address)
    t, _ = sync_in_thread(receiver)
    Publisher(sender.address).publish(TinyNet(seed=2).state_dict(), 1, wait=True, timeout_s=30)
    t.finish(30)
    from weightsync.transports.shm import SHM_DIR, owner_key

    # This process's segments for this sender: the two staging buffers.
    mine = f"weightsync-{owner_key(sender.settings.listen)}-{os.getpid()}-"
    paths = [os.path.join(SHM_DIR, n) for n in os.listdir(SHM_DIR) if n.startswith(mine)]
    assert len(paths) == 2
    assert all(os.stat(p).st_mode & 0o777 == 0o600 for p in paths)


def test_receiver_registers_again_after_the_sender_restarts(sock_dir):
    address = f"unix:{sock_dir}/s.sock"
    model = TinyNet(seed=1)
    trainer = TinyNet(seed=2)
    with Sender(address, bucket_size_bytes=4096) as first:
        receiver = TorchReceiver(model, first.address, receiver_id="survivor")
        t, results = sync_in_thread(receiver)
        Publisher(address).publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
        t.finish(30)
        assert results == [1]
    # Between versions, losing the sender only delays the next one.
    t, results = sync_in_thread(receiver)
    with Sender(address, bucket_size_bytes=4096) as second:
        publisher = Publisher(second.address)
        # The receiver backs off before it registers again.
        (status,) = wait_until(
            lambda: publisher.status().receivers, 20, "the receiver did not register again"
        )
        assert status.receiver_id == "survivor" and status.connected
        step(trainer, 2)
        publisher.publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
        t.finish(30)
    assert results == [1] and digests(model) == digests(trainer)


def test_a_killed_sender_fails_the_version_in_flight_and_the_next_heals(sock_dir):
    address = f"unix:{sock_dir}/s.sock"
    model = TinyNet(seed=1)
    trainer = TinyNet(seed=2)
    # Four 1 MiB buckets: with two staging buffers at most two can be announced before the
    # receiver acks, so the version cannot finish once the daemon is gone.
    trainer.embed = torch.nn.Parameter(torch.randn(60000, 16))
    model.embed = torch.nn.Parameter(torch.zeros(60000, 16))
    daemon = sender_process(address)
    pids = [daemon.pid]
    try:
        receiver = TorchReceiver(model, address, receiver_id="survivor")
        load = receiver.target.load

        def load_then_kill_the_sender(tensors):
            load(tensors)
            receiver.target.load = load  # only once
            daemon.kill()
            daemon.wait(10)

        receiver.target.load = load_then_kill_the_sender
        t, results = sync_in_thread(receiver)
        with pytest.raises(WeightSyncError):  # the publisher loses it too
            Publisher(address).publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
        t.finish(30)
        assert isinstance(results[0], TransportError), results
        assert "during a version" in str(results[0])
        assert receiver.dirty and receiver.applied_version == 0
        daemon = sender_process(address)
        pids.append(daemon.pid)
        t, results = sync_in_thread(receiver)
        publisher = Publisher(address)
        # The receiver backs off before it registers again.
        wait_until(lambda: publisher.status().receivers, 20, "the receiver did not register again")
        publisher.publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
        t.finish(30)
        assert results == [1] and not receiver.dirty
        assert digests(model) == digests(trainer)
    finally:
        daemon.kill()
        # A killed daemon cannot unlink its shared memory.
        for pid in pids:
            for path in glob.glob(f"/dev/shm/weightsync-*-{pid}-*"):
                os.unlink(path)


def test_an_engine_error_mid_version_fails_it_at_once_names_the_bucket_and_marks_dirty(sender):
    """A target's own exception type (engines raise RuntimeError and friends) reaches the
    sender as the receiver's failure right away, not after the ack timeout."""
    from weightsync.receiver.core import ReceiverCore
    from weightsync.receiver.torch_receiver import TorchModuleTarget

    class Breaks(TorchModuleTarget):
        loads = 0
        aborted = None

        def load(self, tensors):
            Breaks.loads += 1
            if Breaks.loads == 2:
                raise RuntimeError("CUDA error: out of memory")
            super().load(tensors)

        def abort(self, manifest, error):
            Breaks.aborted = error

    receiver = ReceiverCore(Breaks(TinyNet(seed=1)), sender.address, receiver_id="breaks")
    t, results = sync_in_thread(receiver)
    start = time.monotonic()
    with pytest.raises(
        ReceiverFailedError,
        match="breaks: WeightSyncError: version 1, bucket 1: RuntimeError: CUDA error: out of",
    ):
        Publisher(sender.address).publish(TinyNet(seed=2).state_dict(), 1, wait=True, timeout_s=60)
    assert time.monotonic() - start < 10
    t.finish(10)
    assert isinstance(results[0], WeightSyncError) and "bucket 1" in str(results[0])
    assert isinstance(results[0].__cause__, RuntimeError)
    assert receiver.dirty and Breaks.aborted is results[0]
    (status,) = Publisher(sender.address).status().receivers
    assert status.state == "dirty"
