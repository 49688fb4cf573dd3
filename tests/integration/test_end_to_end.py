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


def test_later_versions_send_the_begin_and_the_manifest_by_key(sender, monkeypatch):
    """From version 2 the publisher sends its begin as its key alone (no manifest, no offer)
    and the receiver gets the manifest as its key alone; each side kept them for its stream,
    so every version still lands exactly."""
    from weightsync.receiver import TorchReceiver
    from weightsync.receiver.connection import KeptByStream

    starts = []
    complete = KeptByStream.complete

    def recording(self, msg):
        if msg.WhichOneof("kind") == "start":
            starts.append((msg.start.manifest.version, len(msg.start.manifest.tensors)))
        return complete(self, msg)

    monkeypatch.setattr(KeptByStream, "complete", recording)
    model, trainer = TinyNet(seed=5), TinyNet(seed=6)
    receiver = TorchReceiver(model, sender.address)
    publisher = Publisher(sender.address)
    begins = []
    for version in (1, 2, 3):
        step(trainer, version)
        t, applied = sync_in_thread(receiver)
        publisher.publish(trainer.state_dict(), version, wait=True, timeout_s=30)
        t.finish(30)
        assert applied == [version]
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, trainer.state_dict()[name]), (version, name)
        if version == 1:
            stream = publisher._stream
            monkeypatch.setattr(stream, "send", _recorded(stream.send, begins))
    sent = [m.begin for m in begins if m.WhichOneof("kind") == "begin"]
    assert [len(b.manifest.tensors) for b in sent] == [0, 0]  # the key alone
    assert sent[0].begin_key and {b.begin_key for b in sent} == {sent[0].begin_key}
    n = len(trainer.state_dict())
    assert starts == [(1, n), (2, 0), (3, 0)]
    receiver.close()


def _recorded(put, into: list):
    def recording(msg):
        into.append(msg)
        put(msg)

    return recording
