"""Issue 16 item 10: a pack that writes wrong bytes fails its version, naming the tensor.

The bucket checksum is taken from the staging buffer after packing, so on its own it would
certify whatever a buggy pack wrote. Every packer now compares what it wrote with its source
on shared-memory (CPU) buffers. The bug is simulated in our own code (a byte flipped right
after the copy), for both packers of the CPU path: the publisher (asked to pack each bucket)
and the sender (packing from shared memory a publisher offered).
"""

from __future__ import annotations

import pytest
import torch

from tests.support import TinyNet, digests, step, sync_in_thread
from tests.support.publishers import offered_copy
from tests.support.waiting import wait_until
from weightsync.errors import ChecksumError, WeightSyncError
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher

BROKEN = "proj"
"""The tensor whose packed bytes get a flipped bit (bf16: checked as 16-bit integers)."""


def flip_first_element(dst: torch.Tensor) -> None:
    bits = dst.view(torch.int16).view(-1)
    bits[0] ^= 1


def sabotage_publisher(monkeypatch, source: torch.Tensor) -> None:
    import weightsync.sender.publisher as publisher_module

    real = publisher_module.pack_entry

    def pack_entry(buffer, entry, tensor):
        real(buffer, entry, tensor)
        if entry.name == BROKEN:
            flip_first_element(buffer[entry.offset : entry.offset + entry.nbytes])

    monkeypatch.setattr(publisher_module, "pack_entry", pack_entry)
    # On CPU buffers the publisher copies and checks block by block (blocked_copies): break
    # the copies of the tensor's memory there.
    _break_copies_from(monkeypatch, lambda src: _storage(src) == _storage(source))


def sabotage_sender(monkeypatch, source: torch.Tensor) -> None:
    # The sender maps the offered file itself (from the descriptor the publisher passed), at
    # another address: the source is known by its place in the file.
    _break_copies_from(monkeypatch, lambda src: _offset(src) == _offset(source))


def _break_copies_from(monkeypatch, broken) -> None:
    """Flip a bit of every copy whose source is ``broken``, right after it."""
    from weightsync.blocked_copies import BlockedCopies
    from weightsync.regions import CopyBatch

    real = CopyBatch.run

    def run(batch) -> None:
        real(batch)
        pairs = [*zip(batch.dsts, batch.srcs, strict=True), *batch.one_by_one]
        for dst, src in pairs:
            if broken(src):
                flip_first_element(dst)

    # The sender builds its copies once and runs them every version: break the run.
    monkeypatch.setattr(CopyBatch, "run", run)
    # On CPU buffers the copies are blocked_copies' (a CopyBatch only for strided or cast ones).
    real_copy = BlockedCopies._copy

    def copy(step) -> None:
        real_copy(step)
        for piece in step.pieces:
            if broken(piece.src):
                flip_first_element(piece.dst)

    monkeypatch.setattr(BlockedCopies, "_copy", staticmethod(copy))


def _offset(t: torch.Tensor) -> int:
    return t.data_ptr() - t.untyped_storage().data_ptr()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("packer", ["publisher", "sender"])
def test_a_pack_that_writes_wrong_bytes_fails_the_version_naming_the_tensor(
    packer, sender, monkeypatch
):
    from weightsync.transports import get_transport

    model = TinyNet(seed=1)
    receiver = TorchReceiver(model, sender.address, receiver_id="r")
    trainer = TinyNet(seed=2)
    store, tensors = offered_copy(trainer.state_dict()) if packer == "sender" else (None, None)
    publisher = Publisher(sender.address)
    t, results = sync_in_thread(receiver, n=3)

    def publish(version: int):
        step(trainer, version)
        if tensors is None:
            return publisher.publish(trainer.state_dict(), version, wait=True, timeout_s=30)
        for name, value in trainer.state_dict().items():
            tensors[name].copy_(value)
        return publisher.publish(tensors, version, wait=True, timeout_s=30)

    try:
        assert publish(1).status.sender_packed == (packer == "sender")
        applied = digests(model)
        with monkeypatch.context() as patch:
            if packer == "publisher":
                sabotage_publisher(patch, trainer.state_dict()[BROKEN])
            else:
                sabotage_sender(patch, tensors[BROKEN])
            with pytest.raises(WeightSyncError, match=f"tensor '{BROKEN}' was packed wrong") as e:
                publish(2)
        if packer == "publisher":
            assert isinstance(e.value, ChecksumError)
        assert "version 2, bucket" in str(e.value)
        # The publisher raises as soon as it finds the wrong bytes; the sender hears of it on
        # the publisher's stream, and the receiver from the sender, a moment later.
        wait_until(
            lambda: [v.state for v in publisher.status().versions if v.version == 2] == ["failed"],
            30,
            "the sender did not fail version 2",
        )
        wait_until(lambda: len(results) >= 2, 30, "the receiver did not end version 2")
        # Version 2 was not committed, and the wrong bytes never reached the receiver (the
        # buckets before the broken one may have: then it is dirty, a mix).
        assert isinstance(results[1], WeightSyncError)
        assert receiver.applied_version == 1 and digests(model)[BROKEN] == applied[BROKEN]
        assert receiver.dirty or digests(model) == applied
        publish(3)
        t.finish(30)
        assert results[2] == 3 and digests(model) == digests(trainer)
    finally:
        if store is not None:
            get_transport("shm").release(store)
