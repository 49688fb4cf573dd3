"""The broadcast data path over gloo (the same code runs NCCL for CUDA staging)."""

from __future__ import annotations

import time

import pytest

from tests.support import (
    TinyNet,
    assert_applied,
    digests,
    next_outcomes,
    publish_versions,
    start_receivers,
    step,
)
from weightsync.errors import ReceiverFailedError
from weightsync.sender import Publisher
from weightsync.sender.daemon import Sender


def test_broadcast_to_receiver_processes_is_bit_exact(sock_dir):
    with Sender("127.0.0.1:0", bucket_size_bytes=4096, transport="nccl") as sender:
        procs, out = start_receivers(sender.address, ["b0", "b1"], syncs=3)
        trainer = TinyNet(seed=1)
        publisher = Publisher(sender.address)
        expected, _ = publish_versions(publisher, trainer, (1, 2, 3))
        assert_applied(next_outcomes(out, 6), expected)
        paths = {r.receiver_id: r.data_path for r in publisher.status().receivers}
        assert paths == {"b0": "broadcast", "b1": "broadcast"}
        for p in procs:
            p.join(30)


def test_remote_host_gets_broadcast_while_local_maps_and_a_dying_remote_fails_alone(sock_dir):
    with Sender("127.0.0.1:0", bucket_size_bytes=4096, ack_timeout_s=5) as sender:
        procs, out = start_receivers(
            sender.address,
            ["local", "remote"],
            syncs=3,
            die_on_version={"remote": 2},
            env={"remote": {"WEIGHTSYNC_HOST_ID": "another-host"}},
        )
        trainer = TinyNet(seed=1)
        publisher = Publisher(sender.address)
        publisher.publish(trainer.state_dict(), 1, wait=True, timeout_s=60)
        paths = {r.receiver_id: r.data_path for r in publisher.status().receivers}
        assert paths == {"local": "map", "remote": "broadcast"}
        step(trainer, 2)
        start = time.monotonic()
        with pytest.raises(ReceiverFailedError, match="remote"):
            publisher.publish(trainer.state_dict(), 2, wait=True, timeout_s=60)
        assert time.monotonic() - start < 30
        outcomes = {o.receiver_id: o.state for o in publisher.status().versions[-1].receivers}
        assert outcomes == {"local": "applied", "remote": "failed"}
        step(trainer, 3)
        publisher.publish(trainer.state_dict(), 3, wait=True, timeout_s=60)
        local = [r for r in next_outcomes(out, 4) if r[0] == "local"]
        assert [(r[1], r[2]) for r in local] == [("applied", 1), ("applied", 2), ("applied", 3)]
        assert local[-1][3] == digests(trainer)
