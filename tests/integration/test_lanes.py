"""Clients on the sender's host move their streams to lanes (``weightsync/control/lanes.py``)
unless either side turns them off; a stream on a lane and one on gRPC carry the same
versions, bit-exact, and a lane's peer that goes away is noticed at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.support import TinyNet, digests, step, sync_in_thread, wait_until
from weightsync.control.lanes import Lane
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher, Sender


def lanes_by_receiver(sender) -> dict[str, bool]:
    return {r.receiver_id: r.lane for r in sender.coordinator.status().receivers}


def test_a_receiver_on_a_lane_and_one_on_grpc_apply_the_same_versions(sender, monkeypatch):
    trainer = TinyNet(seed=2)
    on_lane, on_grpc = TinyNet(seed=1), TinyNet(seed=3)
    lane_receiver = TorchReceiver(on_lane, sender.address, receiver_id="lane")
    monkeypatch.setenv("WEIGHTSYNC_LANES", "0")  # read when a client says hello
    grpc_receiver = TorchReceiver(on_grpc, sender.address, receiver_id="grpc")
    monkeypatch.delenv("WEIGHTSYNC_LANES")
    lane_syncs, _ = sync_in_thread(lane_receiver, n=3)
    grpc_syncs, _ = sync_in_thread(grpc_receiver, n=3)
    with Publisher(sender.address) as publisher:
        for version in (1, 2, 3):
            step(trainer, version)
            publisher.publish(trainer.state_dict(), version, wait=True, timeout_s=30)
        (status,) = sender.coordinator.status().publishers
        assert status.ranks_on_lanes == 1
    assert lane_syncs.finish(30) == grpc_syncs.finish(30) == [1, 2, 3]
    assert digests(on_lane) == digests(on_grpc) == digests(trainer)
    assert lanes_by_receiver(sender) == {"lane": True, "grpc": False}
    lane_receiver.close()
    grpc_receiver.close()


def test_a_sender_with_lanes_off_keeps_every_stream_on_grpc(sock_dir):
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=4096, lanes=False) as sender:
        model, trainer = TinyNet(seed=1), TinyNet(seed=2)
        receiver = TorchReceiver(model, sender.address, receiver_id="r")
        syncs, _ = sync_in_thread(receiver)
        with Publisher(sender.address) as publisher:
            publisher.publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
            assert sender.coordinator.status().publishers[0].ranks_on_lanes == 0
        assert syncs.finish(30) == [1] and digests(model) == digests(trainer)
        assert lanes_by_receiver(sender) == {"r": False}
        receiver.close()


RECEIVER = textwrap.dedent(
    """
    import sys, time
    from tests.support import TinyNet
    from weightsync.receiver import TorchReceiver
    receiver = TorchReceiver(TinyNet(seed=1), sys.argv[1], receiver_id="doomed")
    print("registered", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.timeout(120)
def test_a_killed_receiver_on_a_lane_is_disconnected_at_once(sender):
    """Its lane and its gRPC stream end with the process; the sender reads the lane's end
    and lets the receiver go (no thread waits on a lane nobody writes)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, sender.address],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert proc.stdout.readline().strip() == "registered"
        wait_until(lambda: lanes_by_receiver(sender).get("doomed"), 10, "the lane to be taken")
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(
            lambda: not sender.coordinator.status().receivers[0].connected,
            5,
            "the sender to notice the kill",
        )
        assert time.monotonic() - killed < 5
    finally:
        proc.kill()
        proc.wait()


class ManyTensors(torch.nn.Module):
    """2,000 small parameters with long names: a manifest of about 0.3 MB, over a Unix
    socket's buffer, so the version's start cannot be written to the lane at once."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.params = torch.nn.ParameterDict(
            {
                f"layer_{i:04d}_" + "x" * 120: torch.nn.Parameter(
                    torch.randn(4, generator=generator)
                )
                for i in range(2000)
            }
        )


def test_a_message_larger_than_the_socket_takes_at_once_is_finished_by_the_stream(
    sender, monkeypatch
):
    """On a lane the thread that queues a message writes it without blocking (it may hold the
    sender's lock); what the socket does not take goes to the stream's thread, and everything
    after it waits behind it, so the receiver still gets whole messages in order."""
    leftovers = []
    try_send = Lane.try_send

    def recording(self, msg):
        rest = try_send(self, msg)
        if rest is not None:
            leftovers.append(len(rest))
        return rest

    monkeypatch.setattr(Lane, "try_send", recording)
    model, trainer = ManyTensors(seed=1), ManyTensors(seed=2)
    receiver = TorchReceiver(model, sender.address, receiver_id="r")
    syncs, _ = sync_in_thread(receiver, n=2)
    with Publisher(sender.address) as publisher:
        for version in (1, 2):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(version)
            publisher.publish(trainer.state_dict(), version, wait=True, timeout_s=60)
    assert syncs.finish(60) == [1, 2]
    assert digests(model) == digests(trainer)
    assert lanes_by_receiver(sender) == {"r": True}
    assert leftovers, "every message fit the socket: the test no longer covers the rest"
    receiver.close()
