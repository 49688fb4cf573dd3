"""The version history's WaitApplied, and the checks of publishers' and receivers' hellos, without
sockets."""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.sender_parts import SenderParts, new_run, sender_parts
from weightsync.errors import ConfigError, ProtocolError, SyncTimeoutError, TransportError
from weightsync.sender.hellos import check_publisher_hello, check_receiver_hello
from weightsync.sender.states import VersionState
from weightsync.sender.version import Version
from weightsync.v1 import weightsync_pb2 as pb


@pytest.fixture
def parts():
    return sender_parts()


def publish(parts: SenderParts, version: int) -> Version:
    """A version with no receivers, staged: complete at once."""
    run = new_run(parts, version)
    with parts.cond:
        parts.history.check_version(version)
        parts.history.add_run(run)
        run.state = VersionState.STAGED
        run.maybe_complete()
    return run


def waiting(parts: SenderParts, version: int, **kwargs) -> tuple[threading.Thread, list]:
    out: list = []

    def run():
        try:
            out.append(parts.history.wait_applied(version, **kwargs))
        except Exception as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_waiter_is_released_by_its_own_version_only(parts):
    t, out = waiting(parts, 3, timeout_s=10)
    for version in (1, 2):
        publish(parts, version)
        t.join(0.2)
        assert t.is_alive() and out == []
    publish(parts, 3)
    t.join(5)
    assert [s.version for s in out] == [3] and out[0].state == "complete"


def test_a_waiter_times_out_naming_the_version(parts):
    publish(parts, 1)
    start = time.monotonic()
    with pytest.raises(SyncTimeoutError) as info:
        parts.history.wait_applied(4, timeout_s=0.3)
    assert str(info.value) == (
        "version 4 was not published within 0.3 s (the last published version is 1)"
    )
    assert 0.25 < time.monotonic() - start < 3


def test_a_waiter_whose_caller_left_or_whose_sender_closed_stops(parts):
    with pytest.raises(ProtocolError, match=r"the caller of WaitApplied\(2\) left"):
        parts.history.wait_applied(2, timeout_s=0, alive=lambda: False)
    t, out = waiting(parts, 2, timeout_s=0)
    t.join(0.3)
    assert t.is_alive()
    parts.history.close()
    t.join(5)
    assert len(out) == 1 and isinstance(out[0], TransportError)
    assert str(out[0]) == "the sender shut down while WaitApplied waited for version 2"


@pytest.mark.parametrize(
    ("hello", "message"),
    [
        ({"device": ""}, "PublisherHello.device is empty"),
        ({"device": "cuda:x"}, "PublisherHello.device 'cuda:x' is not a device"),
        ({"device": "xla"}, "PublisherHello.device 'xla' is not supported"),
        ({"device": "cpu", "rank": 1}, "publisher rank 1 is not below world_size 1"),
    ],
)
def test_a_bad_publisher_hello_names_its_field(hello, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_publisher_hello(pb.PublisherHello(**hello))


def test_good_hellos_pass():
    check_publisher_hello(pb.PublisherHello(device="cpu"))
    check_publisher_hello(pb.PublisherHello(device="cpu", rank=3, world_size=4))
    for device in ("", "cpu", "cuda:7", "cuda"):
        check_receiver_hello(pb.ReceiverHello(device=device))
    with pytest.raises(ConfigError, match="ReceiverHello.device 'gpu0' is not a device"):
        check_receiver_hello(pb.ReceiverHello(device="gpu0"))


def test_a_receiver_hello_naming_an_unknown_transport_is_refused():
    """Issue 35 item 8: a transport name no sender knows was taken silently (the receiver then
    failed every version with a TransportError); it is refused, the known ones named."""
    from weightsync.sender.hellos import RECEIVER_TRANSPORTS
    from weightsync.transports import _CLASSES

    assert set(RECEIVER_TRANSPORTS) == set(_CLASSES)
    check_receiver_hello(pb.ReceiverHello(transports=["shm", "cuda_ipc"]))
    check_receiver_hello(pb.ReceiverHello(transports=[]))
    with pytest.raises(ConfigError) as e:
        check_receiver_hello(pb.ReceiverHello(transports=["shm", "rdma"]))
    assert str(e.value) == (
        "ReceiverHello.transports[1] 'rdma' is not a transport; known: shm, cuda_ipc "
        "(or send none: any)"
    )
