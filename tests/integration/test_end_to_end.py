"""gRPC end to end over a real unix socket: 2 receiver processes, 3 versions, bit-exact."""

from __future__ import annotations

import torch

from tests.support import (
    TinyNet,
    assert_applied,
    next_outcomes,
    publish_versions,
    start_receivers,
    step,
    sync_in_thread,
)
from weightsync.sender import Publisher


def test_two_receiver_processes_get_three_versions_bit_exact(sender):
    procs, out = start_receivers(sender.address, ["r0", "r1"], syncs=3)
    trainer = TinyNet(seed=1)
    publisher = Publisher(sender.address)
    expected, results = publish_versions(publisher, trainer, (1, 2, 3))
    for result in results:
        assert result.receivers == 2
        assert [o.state for o in result.status.receivers] == ["applied", "applied"]
    assert_applied(next_outcomes(out, 6), expected)
    status = publisher.status()
    # The receiver processes may already have exited after their last sync.
    assert [(r.receiver_id, r.applied_version) for r in status.receivers] == [("r0", 3), ("r1", 3)]
    assert {r.state for r in status.receivers} <= {"idle", "disconnected"}
    v3 = status.versions[-1]
    assert (
        v3.state == "complete"
        and v3.num_buckets > 2
        and v3.total_bytes
        == sum(t.numel() * t.element_size() for t in trainer.state_dict().values())
    )
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0


def test_publish_without_wait_returns_once_staged_and_tensors_may_change(sender):
    from weightsync.receiver import TorchReceiver

    model = TinyNet(seed=5)
    receiver = TorchReceiver(model, sender.address)
    trainer = TinyNet(seed=6)
    snapshot = {k: v.clone() for k, v in trainer.state_dict().items()}
    t, applied = sync_in_thread(receiver)
    publisher = Publisher(sender.address)
    publisher.publish(trainer.state_dict(), 1)
    step(trainer, 99)  # the trainer steps right away: the receiver must still get version 1
    publisher.wait_applied(1, timeout_s=30)
    t.finish(30)
    assert applied == [1]
    for name, t_ in model.state_dict().items():
        assert torch.equal(t_, snapshot[name]), name
