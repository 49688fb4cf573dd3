"""The staged pipeline over shm, end to end: buffers reused only after every receiver acked,
buckets in order, the direct/staged decision, the sender packing offered memory itself.
(The planner and the staging slots have unit tests: ``tests/unit/test_sender_*.py``.)"""

from __future__ import annotations

import time

import torch

from tests.support import TinyNet, digests, step, sync_in_thread
from tests.support.publishers import offered_copy
from weightsync.receiver import ReceiverCore, TorchReceiver
from weightsync.receiver.torch_receiver import TorchModuleTarget
from weightsync.sender import Publisher, Sender


class SlowTarget(TorchModuleTarget):
    """Loads each bucket late: if the sender reused its buffer early, it would copy the
    next bucket's bytes and the weights would come out wrong."""

    def __init__(self, module, delay_s: float) -> None:
        super().__init__(module)
        self.delay_s = delay_s
        self.order: list[str] = []

    def load(self, tensors):
        time.sleep(self.delay_s)
        self.order.extend(name for name, _ in tensors)
        super().load(tensors)


def test_a_buffer_is_reused_only_after_every_receiver_acked_it(sock_dir):
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024, num_buffers=2) as sender:
        fast_model, slow_model = TinyNet(seed=1), TinyNet(seed=2)
        fast = TorchReceiver(fast_model, sender.address, receiver_id="fast")
        slow_target = SlowTarget(slow_model, delay_s=0.05)
        slow = ReceiverCore(slow_target, sender.address, receiver_id="slow")
        trainer = TinyNet(seed=3)
        publisher = Publisher(sender.address)
        for version in (1, 2):
            step(trainer, version)
            threads = [sync_in_thread(r)[0] for r in (fast, slow)]
            result = publisher.publish(trainer.state_dict(), version, wait=True, timeout_s=60)
            assert [t.finish(60) for t in threads] == [[version], [version]]
            assert result.status.num_buckets > 2 * sender.settings.num_buffers
            assert digests(fast_model) == digests(trainer) == digests(slow_model)
        # Complete tensors reach the target in manifest order (chunked ones are written in
        # place as their chunks come and are not listed here).
        whole = [n for n in trainer.state_dict() if n != "embed"]
        assert slow_target.order[: len(whole)] == whole


def test_direct_needs_cuda_ipc_and_every_receiver_mapping(sock_dir):
    """On CPU staging nothing is direct: every tensor is staged (direct reads need CUDA IPC)."""
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=4096) as sender:
        model = TinyNet(seed=1)
        receiver = TorchReceiver(model, sender.address)
        t, _ = sync_in_thread(receiver)
        trainer = TinyNet(seed=2)
        result = Publisher(sender.address).publish(
            trainer.state_dict(), 1, wait=True, timeout_s=60, direct=True
        )
        assert t.finish(60) == [1]
        assert result.status.direct_bytes == 0
        assert result.status.staged_bytes == result.status.total_bytes
        assert digests(model) == digests(trainer)


def test_the_sender_packs_offered_shared_memory_itself_and_the_publisher_never_packs(
    sock_dir, monkeypatch
):
    """A trainer whose tensors live in a shm buffer it allocated offers them: the sender maps
    them and packs every bucket (chunked ones too) without a round trip to the publisher,
    three times (then from the copies it worked out the first time), bit-exact. The receiver
    too works out its copies of each mapped bucket once per staging buffer
    (``InPlaceTarget.load_summed``)."""
    import weightsync.sender.publisher as publisher_module
    from weightsync.transports import get_transport

    def never(*args):
        raise AssertionError("the publisher was asked to pack")

    monkeypatch.setattr(publisher_module, "pack_entry", never)
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024) as sender:
        store, tensors = offered_copy(TinyNet(seed=3).state_dict())
        try:
            model = TinyNet(seed=1)
            receiver = TorchReceiver(model, sender.address)
            built, pairs = [], receiver.target.copy_pairs
            receiver.target.copy_pairs = lambda views: built.append(views) or pairs(views)
            publisher = Publisher(sender.address)
            for version in (1, 2, 3):
                t, _ = sync_in_thread(receiver)
                result = publisher.publish(tensors, version, wait=True, timeout_s=60)
                assert t.finish(60) == [version]
                assert result.status.sender_packed
                assert result.status.num_buckets > 2
                live = model.state_dict()
                assert all(torch.equal(live[n], tensors[n]) for n in tensors), version
                for v in tensors.values():  # a stand-in optimizer step, in place
                    v.add_(1)
            # Staging slots rotate, so a bucket meets a new buffer now and then; a bucket in a
            # buffer it was in before reuses its copies: no key was worked out twice.
            assert built and len(built) == len(receiver.target._batches)
        finally:
            get_transport("shm").release(store)
