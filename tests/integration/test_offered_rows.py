"""A publisher offering its own memory the sender cannot pack from falls back to packing each
bucket itself (``pack``, protocol §3.1) and the version arrives bit-exact, instead of being
abandoned with its number used up: a tensor whose dim-0 row is wider than a bucket (issue 35;
the sender packs offered regions by whole rows), or tensors in more storages than an offer may
name (an HF-layout MoE trainer: a storage per expert weight)."""

from __future__ import annotations

import torch

from tests.support import sync_in_thread
from tests.support.publishers import offered_copy
from weightsync import limits
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


def _publish(tmp_path, model: torch.nn.Module, offered: dict, versions: int) -> list[int]:
    """Publish ``offered`` ``versions`` times into ``model``; each version must have been
    packed by the publisher. Returns the versions the receiver applied."""
    with (
        Sender(f"unix:{tmp_path}/s.sock", bucket_size_bytes=BUCKET) as sender,
        Publisher(sender.address) as publisher,
    ):
        receiver = TorchReceiver(model, sender.address, receiver_id="r")
        thread, results = sync_in_thread(receiver, n=versions)
        try:
            for version in range(1, versions + 1):
                result = publisher.publish(offered, version, wait=True, timeout_s=60)
                assert not result.status.sender_packed
            thread.finish(60)
        finally:
            receiver.close()
    return results


def test_rows_wider_than_a_bucket_are_packed_by_the_publisher_instead(tmp_path):
    from weightsync.transports import get_transport

    trainer, model = Wide(seed=1), Wide(seed=2)
    store, offered = offered_copy(trainer.state_dict())
    try:
        assert _publish(tmp_path, model, offered, 1) == [1]
    finally:
        get_transport("shm").release(store)
    for name, value in trainer.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_tensors_in_more_storages_than_an_offer_may_name_are_packed_by_the_publisher(
    tmp_path, monkeypatch, caplog
):
    """Each tensor in a storage of its own, one more than ``limits.MAX_SOURCES`` (lowered
    here): the publisher does not offer them, says why once, and every version arrives."""
    from weightsync.transports import get_transport

    monkeypatch.setattr(limits, "MAX_SOURCES", 3)
    model = torch.nn.Module()
    model.experts = torch.nn.ModuleList(torch.nn.Linear(4, 8, bias=False) for _ in range(4))
    trainer = {f"experts.{i}.weight": torch.full((8, 4), float(i)) for i in range(4)}
    stores, offered = [], {}
    for name, value in trainer.items():
        store, copies = offered_copy({name: value})
        stores.append(store)
        offered.update(copies)
    caplog.set_level("WARNING", "weightsync.exports")
    try:
        assert _publish(tmp_path, model, offered, 2) == [1, 2]
    finally:
        for store in stores:
            get_transport("shm").release(store)
    for name, value in trainer.items():
        assert torch.equal(model.state_dict()[name], value), name
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "weightsync.exports"]
    assert "4 storages, over the 3 one offer may name" in warning, warning
