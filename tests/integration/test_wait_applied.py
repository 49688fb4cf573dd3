"""WaitApplied waits for a version that is not published yet (until its timeout); a version
that can never come fails at once, saying why."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from tests.support import unix_sender
from tests.support.raw_streams import RawStream
from weightsync.control.client import connect
from weightsync.errors import SyncTimeoutError, TransportError, VersionError
from weightsync.sender import Publisher
from weightsync.transports import get_transport
from weightsync.v1 import weightsync_pb2 as pb

W = {"w": torch.ones(4)}


class Waiter(threading.Thread):
    """``Publisher.wait_applied(version)`` on a thread of its own; ``result`` or ``error``."""

    def __init__(self, address: str, version: int, timeout_s: float = 30) -> None:
        super().__init__(daemon=True)
        self.address, self.version, self.timeout_s = address, version, timeout_s
        self.result: pb.VersionStatus | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            with Publisher(self.address, publisher_id="waiter") as p:
                self.result = p.wait_applied(self.version, timeout_s=self.timeout_s)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e


def _raw_wait(address: str, version: int, timeout_s: float) -> grpc.RpcError:
    channel, stub = connect(address, 10)
    with channel:
        with pytest.raises(grpc.RpcError) as info:
            stub.WaitApplied(
                pb.WaitAppliedRequest(version=version, timeout_s=timeout_s), timeout=timeout_s + 10
            )
    return info.value


def test_a_waiter_for_a_version_not_yet_published_gets_that_versions_status(sender):
    waiter = Waiter(sender.address, 3)
    time.sleep(0.5)  # it is waiting before anything is published
    assert waiter.is_alive() and waiter.error is None
    publisher = Publisher(sender.address)
    for version in (1, 2):
        publisher.publish(W, version)
        time.sleep(0.3)
        assert waiter.is_alive(), f"released by version {version}: {waiter.result or waiter.error}"
    publisher.publish({"w": torch.ones(8)}, 3)
    waiter.join(10)
    assert not waiter.is_alive() and waiter.error is None
    assert waiter.result.version == 3 and waiter.result.state == "complete"
    assert waiter.result.total_bytes == 32  # version 3's own status


def test_waiting_past_the_timeout_names_the_version(sender):
    Publisher(sender.address).publish(W, 1)
    start = time.monotonic()
    with pytest.raises(
        SyncTimeoutError,
        match=r"wait for version 7 at .*: version 7 was not published within 1 s "
        r"\(the last published version is 1\)",
    ):
        Publisher(sender.address).wait_applied(7, timeout_s=1)
    assert 0.9 < time.monotonic() - start < 5
    error = _raw_wait(sender.address, 8, 0.5)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.details() == (
        "SyncTimeoutError: version 8 was not published within 0.5 s "
        "(the last published version is 1)"
    )


def test_a_version_that_will_never_come_fails_at_once(sender):
    publisher = Publisher(sender.address)
    publisher.publish(W, 1)
    publisher.publish(W, 3)
    cases = {
        2: "VersionError: version 2 was never published on this sender and never will be: "
        "versions only increase and the last published is 3",
        0: "VersionError: version 0 is never published: versions start at 1",
    }
    for version, details in cases.items():
        start = time.monotonic()
        error = _raw_wait(sender.address, version, 30)
        assert time.monotonic() - start < 3
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.details() == details
    with pytest.raises(VersionError, match="version 2 was never published"):
        publisher.wait_applied(2, timeout_s=30)


def test_a_waiter_whose_version_is_skipped_fails_when_a_later_one_is_published(sender):
    publisher = Publisher(sender.address)
    publisher.publish(W, 1)
    waiter = Waiter(sender.address, 2)
    time.sleep(0.3)
    assert waiter.is_alive()
    publisher.publish(W, 3)  # 2 is skipped: it can never come now
    waiter.join(5)
    assert not waiter.is_alive()
    assert isinstance(waiter.error, VersionError)
    assert "version 2 was never published on this sender and never will be" in str(waiter.error)


def test_a_version_older_than_the_history_fails_at_once():
    with unix_sender(history=2) as s:
        publisher = Publisher(s.address)
        for version in (1, 2, 3):
            publisher.publish(W, version)
        assert publisher.wait_applied(2, timeout_s=5).version == 2  # still in the history
        error = _raw_wait(s.address, 1, 30)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.details() == (
            "VersionError: version 1 is older than this sender's history (it keeps the last 2 "
            "versions, now 2..3); its status is gone"
        )


def test_a_waiter_is_released_when_the_sender_shuts_down():
    with unix_sender() as s:
        waiter = Waiter(s.address, 5, timeout_s=0)  # 0: no limit
        time.sleep(0.5)
        assert waiter.is_alive()
        start = time.monotonic()
        s.close()
        waiter.join(10)
    assert time.monotonic() - start < 10 and not waiter.is_alive()
    assert isinstance(waiter.error, TransportError), repr(waiter.error)


@pytest.mark.parametrize(
    ("staged_in_done", "kinds"), [(True, ["done"]), (False, ["staged", "done"])]
)
def test_a_publisher_that_waits_gets_done_alone_once_it_says_it_takes_done_as_staged(
    sender, staged_in_done, kinds
):
    """One message less per version for weightsync's publishers; a client that did not say
    so still gets ``staged`` before ``done``."""
    hello = pb.PublisherHello(publisher_id="raw", device="cpu", staged_in_done=staged_in_done)
    raw = RawStream(sender.address, "Publish", pb.PublisherMessage(hello=hello))
    assert raw.first() == "welcome"
    manifest = pb.Manifest(version=1, tensors=[pb.TensorSpec(name="w", dtype="float32", shape=[4])])
    raw.send(pb.PublisherMessage(begin=pb.BeginVersion(manifest=manifest, wait_applied=True)))
    got = []
    for reply in raw.replies:
        kind = reply.WhichOneof("kind")
        if kind == "pack":
            buffer = get_transport("shm").map(reply.pack.buffer)
            for e in reply.pack.layout.entries:  # written: the sender checks (stamps)
                buffer[e.offset : e.offset + e.nbytes] = 0
            packed = pb.BucketPacked(version=1, index=reply.pack.layout.index)
            raw.send(pb.PublisherMessage(packed=packed))
            continue
        got.append(kind)
        if kind == "done":
            assert reply.done.state == "complete"
            break
    raw.close()
    assert got == kinds
