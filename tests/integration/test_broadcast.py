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


def test_views_of_a_landing_buffer_are_kept_until_a_bigger_bucket_replaces_it(sock_dir):
    """A broadcast bucket lands in one of two reused buffers: its views and the target's
    copies are worked out once and used again every version (4,719 of them cost an MoE model
    tens of milliseconds a version), and dropped, with the old buffer, when a bigger bucket
    replaces it. Every version lands exactly."""
    import torch

    from tests.support import holder_module, sync_in_thread
    from weightsync.receiver import TorchReceiver

    model = holder_module({"a": torch.zeros(64), "b": torch.zeros(600)})
    with Sender("127.0.0.1:0", bucket_size_bytes=4096, transport="nccl") as sender:
        receiver = TorchReceiver(model, sender.address)
        publisher = Publisher(sender.address)
        (link,) = receiver._links
        batches = []
        for version, names in ((1, "a"), (2, "ab"), (3, "ab")):
            sent = {n: torch.randn(64 if n == "a" else 600) for n in names}
            t, applied = sync_in_thread(receiver)
            publisher.publish(sent, version, wait=True, timeout_s=60)
            t.finish(60)
            assert applied == [version]
            for name, tensor in sent.items():
                assert torch.equal(model.state_dict()[name], tensor), (version, name)
            landed = [k for k in link.reader._views if k[1][0] == "landed"]
            assert len(landed) == 1, landed
            kept = receiver.target._batches.get(("summed", landed[0]), lambda: None)
            assert kept is not None, "no batch kept for the landed views"
            batches.append(kept)
        assert link.broadcast.landings == 2  # version 2's bucket is bigger: the buffer grew
        assert batches[2] is batches[1] and batches[1] is not batches[0]
        receiver.close()
