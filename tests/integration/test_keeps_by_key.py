"""An engine rank declares the boxes it keeps once per stream: later verdicts send their
``keeps_key`` alone (a MoE engine TP rank's thousands of boxes took tens of milliseconds a
version to send and check), and a new stream declares them again."""

from __future__ import annotations

from tests.support import TinyNet, digests, step, sync_in_thread
from weightsync.receiver import ReceiverCore
from weightsync.receiver.torch_receiver import TorchModuleTarget
from weightsync.sender import Publisher, Sender, outcomes
from weightsync.topology_model import Box


class KeepsHalf(TorchModuleTarget):
    """Declares that it keeps the first half of rows of every 2-D tensor (loading all of it)."""

    def keeps(self) -> dict[str, Box]:
        return {
            name: Box((0, 0), (t.shape[0] // 2, t.shape[1]))
            for name, t in self.live.items()
            if t.dim() == 2
        }


def test_boxes_are_declared_once_per_stream_and_kept_by_the_sender(sock_dir, monkeypatch):
    parsed: list[int] = []
    parse = outcomes.boxes_from_pb
    monkeypatch.setattr(
        outcomes, "boxes_from_pb", lambda msgs, *a: parsed.append(len(msgs)) or parse(msgs, *a)
    )
    model, trainer = TinyNet(seed=1), TinyNet(seed=2)
    target = KeepsHalf(model)
    live = model.state_dict()
    halves = sum(t.nbytes // 2 for t in live.values() if t.dim() == 2)
    whole = sum(t.nbytes for t in live.values() if t.dim() != 2)
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024) as sender:
        receiver = ReceiverCore(target, sender.address, receiver_id="half")
        syncs, _ = sync_in_thread(receiver, n=3)
        with Publisher(sender.address) as publisher:
            for version in (1, 2, 3):
                step(trainer, version)
                publisher.publish(trainer.state_dict(), version, wait=True, timeout_s=30)
        syncs.join(30)
        conn = sender.coordinator.registry.receiver("half")
        assert conn.kept_bytes == halves + whole
        assert set(conn.keeps) == {n for n, t in live.items() if t.dim() == 2}
        receiver.close()
    two_d = sum(t.dim() == 2 for t in live.values())
    assert parsed == [two_d]  # version 1 listed them; versions 2 and 3 sent their key alone
    assert digests(model) == digests(trainer)
