"""The collector is paused while a version is in flight (sender, publisher and receiver in one
process here) and runs again once it is over, applied or failed."""

from __future__ import annotations

import gc
import time

import pytest

from tests.support import TinyNet, digests, step, sync_in_thread
from weightsync.errors import ReceiverFailedError
from weightsync.receiver import ReceiverCore
from weightsync.receiver.torch_receiver import TorchModuleTarget
from weightsync.sender import Publisher, Sender


class Watching(TorchModuleTarget):
    """Notes whether the collector ran while it loaded; fails its load when told to."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.collector_on: list[bool] = []
        self.fail = False

    def load(self, tensors) -> None:
        self.collector_on.append(gc.isenabled())
        if self.fail:
            raise RuntimeError("the engine refused the weights")
        super().load(tensors)


def _collector_back(timeout_s: float = 5.0) -> bool:
    # The sender lets go on its own thread right after it sent `done`.
    deadline = time.monotonic() + timeout_s
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.01)
    return gc.isenabled()


def test_the_collector_pauses_for_each_version_applied_or_failed(sock_dir):
    assert gc.isenabled()
    model, trainer = TinyNet(seed=1), TinyNet(seed=2)
    target = Watching(model)
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024) as sender:
        receiver = ReceiverCore(target, sender.address, receiver_id="watching")
        syncs, _ = sync_in_thread(receiver, n=2)
        with Publisher(sender.address) as publisher:
            step(trainer, 1)
            publisher.publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
            assert _collector_back()
            target.fail = True
            step(trainer, 2)
            with pytest.raises(ReceiverFailedError, match="refused the weights"):
                publisher.publish(trainer.state_dict(), 2, wait=True, timeout_s=30)
        results = syncs.finish(30)
        receiver.close()
    assert _collector_back()
    assert target.collector_on and not any(target.collector_on)
    assert results[0] == 1 and isinstance(results[1], Exception)
    step(trainer, 2)
    assert digests(model) != digests(trainer)  # version 2 was refused; 1 stayed
