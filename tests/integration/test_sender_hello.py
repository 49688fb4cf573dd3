"""A hello or begin the sender cannot serve is answered INVALID_ARGUMENT naming the field, and
leaves nothing behind: no thread, no joined rank, no version, no publisher in Status; the
sender still shuts down (a raw ``torch.device('')`` in the stream thread used to hang the
stream with no reply and keep the sender from exiting on SIGTERM)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from tests.support import wait_until
from weightsync.control.client import connect
from weightsync.errors import ConfigError
from weightsync.sender import Publisher
from weightsync.transports import get_transport
from weightsync.v1 import weightsync_pb2 as pb

ONE = [pb.TensorSpec(name="w", dtype="float32", shape=[4])]


class RawPublisher:
    """A Publish stream driven message by message, as a non-weightsync client would."""

    def __init__(self, address: str, **hello) -> None:
        self.channel, stub = connect(address, 10)
        self.requests: queue.Queue = queue.Queue()
        hello = {"publisher_id": "raw", "device": "cpu"} | hello
        self.requests.put(pb.PublisherMessage(hello=pb.PublisherHello(**hello)))
        self.replies = stub.Publish(iter(self.requests.get, None), timeout=15)

    def begin(self, version: int, tensors=ONE) -> None:
        manifest = pb.Manifest(version=version, tensors=tensors)
        self.requests.put(pb.PublisherMessage(begin=pb.BeginVersion(manifest=manifest)))

    def outcome(self) -> tuple[list[str], grpc.StatusCode, str]:
        """The reply kinds until the stream ends (packing when asked, half-closing after
        ``staged``), and its status."""
        kinds = []
        try:
            for reply in self.replies:
                kinds.append(reply.WhichOneof("kind"))
                if kinds[-1] == "pack":
                    buffer = get_transport("shm").map(reply.pack.buffer)
                    for e in reply.pack.layout.entries:  # written: the sender checks (stamps)
                        buffer[e.offset : e.offset + e.nbytes] = 0
                    index, version = reply.pack.layout.index, reply.pack.version
                    packed = pb.BucketPacked(version=version, index=index)
                    self.requests.put(pb.PublisherMessage(packed=packed))
                if kinds[-1] == "staged":
                    self.requests.put(None)
        except grpc.RpcError as e:
            return kinds, e.code(), e.details()
        finally:
            self.requests.put(None)
        return kinds, grpc.StatusCode.OK, ""

    def close(self) -> None:
        self.requests.put(None)
        self.channel.close()


def receive_status(address: str, **hello) -> tuple[grpc.StatusCode, str, str]:
    """Register a receiver with ``hello``: the status code, details and the id welcomed."""
    channel, stub = connect(address, 10)
    gate = threading.Event()

    def requests():
        yield pb.ReceiverMessage(hello=pb.ReceiverHello(**hello))
        gate.wait(15)

    with channel:
        call = stub.Receive(requests(), timeout=15)
        try:
            first = next(call)
        except grpc.RpcError as e:
            return e.code(), e.details(), ""
        finally:
            gate.set()
        call.cancel()
        return grpc.StatusCode.OK, "", first.welcome.receiver_id


def _stream_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("Thread-")}


def assert_nothing_left(sender, last_version: int) -> None:
    co = sender.coordinator
    wait_until(lambda: not co.status().publishers, 10, "Status.publishers to be empty")
    assert co._joining == {}
    assert co.last_version == last_version
    assert [v.version for v in co.status().versions] == list(range(1, last_version + 1))
    assert sender.metrics.registry.get_sample_value("weightsync_publishers_connected") == 0


@pytest.mark.parametrize(
    ("hello", "details"),
    [
        (
            {"device": ""},
            "ConfigError: PublisherHello.device is empty; send 'cpu' or 'cuda:N' "
            "(where this rank's tensors live)",
        ),
        (
            {"device": "bogus"},
            "ConfigError: PublisherHello.device 'bogus' is not a device; send 'cpu' or "
            "'cuda:N' (where this rank's tensors live)",
        ),
        (
            {"device": "meta"},
            "ConfigError: PublisherHello.device 'meta' is not supported; send 'cpu' or "
            "'cuda:N' (where this rank's tensors live)",
        ),
        (
            {"rank": 2, "world_size": 2},
            "ConfigError: publisher rank 2 is not below world_size 2 "
            "(PublisherHello.rank, PublisherHello.world_size)",
        ),
    ],
)
def test_a_bad_publisher_hello_is_invalid_argument_naming_the_field(sender, hello, details):
    Publisher(sender.address).publish({"w": torch.ones(4)}, 1)
    threads = _stream_threads()
    raw = RawPublisher(sender.address, **hello)
    raw.begin(2)
    kinds, code, got = raw.outcome()
    raw.close()
    assert (kinds, code, got) == ([], grpc.StatusCode.INVALID_ARGUMENT, details)
    assert_nothing_left(sender, last_version=1)
    wait_until(lambda: _stream_threads() <= threads, 10, "the stream's threads to end")
    Publisher(sender.address).publish({"w": torch.ones(4)}, 2)  # the sender goes on


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a sender that sees no GPU")
def test_a_cuda_publisher_on_a_cpu_sender_is_invalid_argument(sender):
    raw = RawPublisher(sender.address, device="cuda:7")
    raw.begin(1)
    assert raw.outcome() == (
        [],
        grpc.StatusCode.INVALID_ARGUMENT,
        "ConfigError: PublisherHello.device 'cuda:7': this sender sees no CUDA device; run it "
        "where the trainer's GPUs are visible, or publish CPU tensors",
    )
    raw.close()
    assert_nothing_left(sender, last_version=0)


def test_any_other_failure_while_joining_is_invalid_argument_and_leaves_nothing(
    sender, monkeypatch
):
    """A bug (not a WeightSyncError) while planning: the rank's stream gets INVALID_ARGUMENT;
    the other rank, which had joined, is told the version is abandoned; nothing is kept."""
    co = sender.coordinator

    def broken(*args, **kwargs):
        raise RuntimeError("planner exploded")

    monkeypatch.setattr(co, "_plan_run", broken)
    rank0 = RawPublisher(sender.address, rank=0, world_size=2)
    rank0.begin(1)
    wait_until(lambda: co._joining, 10, "rank 0 to join version 1")
    rank1 = RawPublisher(sender.address, rank=1, world_size=2)
    rank1.begin(1)
    assert rank1.outcome() == (
        ["welcome"],
        grpc.StatusCode.INVALID_ARGUMENT,
        "ConfigError: publisher 'raw' rank 1 could not begin version 1: RuntimeError: planner "
        "exploded; check PublisherHello (device 'cpu', device_uuid '') and BeginVersion "
        "(manifest, sources, pieces)",
    )
    assert rank0.outcome() == (
        ["welcome"],
        grpc.StatusCode.INTERNAL,
        "WeightSyncError: version 1 abandoned: it could not be planned: RuntimeError: planner "
        "exploded",
    )
    rank0.close()
    rank1.close()
    assert_nothing_left(sender, last_version=0)
    monkeypatch.undo()
    Publisher(sender.address).publish({"w": torch.ones(4)}, 1)  # version 1 was never taken
    assert co.last_version == 1


def test_a_rank_that_leaves_while_joining_is_not_left_joined(sender):
    co = sender.coordinator
    rank0 = RawPublisher(sender.address, rank=0, world_size=2)
    rank0.begin(1)
    wait_until(lambda: co._joining, 10, "rank 0 to join version 1")
    rank0.close()
    rank0.replies.cancel()
    wait_until(lambda: not co._joining, 10, "rank 0 to leave the joining version")
    assert_nothing_left(sender, last_version=0)


def test_a_receiver_hello_with_a_malformed_device_is_invalid_argument(sender):
    assert receive_status(sender.address, receiver_id="r", device="bogus") == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "ConfigError: ReceiverHello.device 'bogus' is not a device; send 'cpu', 'cuda:N', or empty",
        "",
    )
    assert sender.coordinator.status().receivers == []
    # A receiver's device is its own (its numbering, maybe another host): any well-formed
    # one registers, even a GPU this sender does not see; empty means unknown.
    for rid, device in (("gpu", "cuda:7"), ("unknown", "")):
        assert receive_status(sender.address, receiver_id=rid, device=device) == (
            grpc.StatusCode.OK,
            "",
            rid,
        )


def test_any_other_failure_while_registering_a_receiver_is_invalid_argument(sender, monkeypatch):
    def broken(hello):
        raise KeyError("boom")

    monkeypatch.setattr(sender.coordinator.registry, "add_receiver", broken)
    code, details, _ = receive_status(sender.address, receiver_id="r", engine="e", device="cpu")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == (
        "ConfigError: receiver 'r' could not register: KeyError: 'boom'; check ReceiverHello "
        "(engine 'e', device 'cpu', transports [], host_id '')"
    )


def test_the_sender_exits_on_sigterm_after_an_empty_device_hello(sock_dir):
    """The conformance finding: the daemon, hit by an empty-device hello, still stops."""
    address = f"unix:{os.path.join(sock_dir, 's.sock')}"
    code = "import sys; from weightsync.app.cli import sender_main; sys.exit(sender_main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--listen", address],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: os.path.exists(address[5:]) or proc.poll() is not None, 90, "listen")
        assert proc.poll() is None, proc.stdout.read().decode()
        raw = RawPublisher(address, device="")
        raw.begin(1)
        assert raw.outcome()[1] == grpc.StatusCode.INVALID_ARGUMENT
        raw.close()
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


EMPTY_MANIFEST = (
    "ConfigError: BeginVersion.manifest of version 2 has no tensors; publish at least one"
)


def test_a_begin_with_an_empty_manifest_is_invalid_argument_and_takes_no_version(sender):
    """An empty manifest used to be planned, started and reported applied by every receiver."""
    Publisher(sender.address).publish({"w": torch.ones(4)}, 1)
    raw = RawPublisher(sender.address)
    raw.begin(2, tensors=[])
    assert raw.outcome() == (["welcome"], grpc.StatusCode.INVALID_ARGUMENT, EMPTY_MANIFEST)
    raw.close()
    assert_nothing_left(sender, last_version=1)
    assert [v.version for v in sender.coordinator.status().versions] == [1]


def test_the_publisher_refuses_an_empty_manifest_before_any_rpc(sender):
    publisher = Publisher(sender.address)
    with pytest.raises(ConfigError) as refused:
        publisher.publish({}, 2)
    assert str(refused.value) == (
        f"publish version 2 to {sender.address}: BeginVersion.manifest of version 2 has no "
        "tensors; publish at least one"
    )
    assert publisher._stream is None  # no Publish stream was opened
    assert sender.coordinator.last_version == 0
    publisher.close()
