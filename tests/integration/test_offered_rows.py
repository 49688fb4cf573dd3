"""A publisher offering its own memory with a tensor whose dim-0 row is wider than a bucket
(issue 35): the sender packs offered regions by whole rows, so such a version falls back to the
publisher packing each bucket (``pack``, protocol §3.1) and arrives bit-exact, instead of being
abandoned with its number used up."""

from __future__ import annotations

import torch

from tests.support import sync_in_thread
from tests.support.publishers import offered_copy
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher
from weightsync.sender.daemon import Sender

BUCKET = 64 * 1024


class Wide(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.wide = torch.nn.Parameter(torch.randn(2, 20_000, generator=g))  # 80,000 B rows
        self.small = torch.nn.Parameter(torch.randn(4, generator=g))


def test_rows_wider_than_a_bucket_are_packed_by_the_publisher_instead(tmp_path):
    from weightsync.transports import get_transport

    trainer, model = Wide(seed=1), Wide(seed=2)
    store, offered = offered_copy(trainer.state_dict())
    with (
        Sender(f"unix:{tmp_path}/s.sock", bucket_size_bytes=BUCKET) as sender,
        Publisher(sender.address) as publisher,
    ):
        receiver = TorchReceiver(model, sender.address, receiver_id="r")
        thread, results = sync_in_thread(receiver, n=1)
        try:
            result = publisher.publish(offered, 1, wait=True, timeout_s=60)
            thread.finish(60)
        finally:
            receiver.close()
            get_transport("shm").release(store)
    assert results == [1]
    assert not result.status.sender_packed
    for name, value in trainer.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
