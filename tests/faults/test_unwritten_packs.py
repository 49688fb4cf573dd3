"""Issue 35 item 7a: a publisher that answers ``pack`` with ``packed`` but writes nothing.

The sender takes each bucket's checksum from its staging slot after ``packed``, so receivers
would apply whatever the slot held before (another version's bytes) under a matching checksum.
Now the sender stamps a nonce at the start of each 64 KiB row of a bucket's entries before it
asks for the bucket, and fails the version when a stamp is still there after ``packed``.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import sync_in_thread
from tests.support.devices import DEVICES
from weightsync.buckets import TensorSpec, pack_entry
from weightsync.errors import WeightSyncError
from weightsync.manifest import VersionManifest
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher
from weightsync.sender.publisher_packs import StampPlaces, stamp_offsets
from weightsync.v1 import weightsync_pb2 as pb

ROWS = 3 * 64 * 1024 // 4 + 100
"""float32 elements of ``w``: four 64 KiB rows of a bucket, the last one partly."""


class One(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(ROWS))


def test_a_stamp_lies_in_each_row_inside_an_entry():
    # Padding (between 10 and 256, after 70404) is never stamped; a row with no 8 bytes of
    # one entry gets none.
    assert stamp_offsets([(0, 10), (256, 70000), (70400, 4), (131072, 200000)]) == [
        0,
        65536,
        131072,
        196608,
        262144,
        327680,
    ]
    assert stamp_offsets([(0, 4), (256, 7)]) == []


def test_the_places_of_a_layout_are_worked_out_once_and_index_their_words():
    places = StampPlaces()
    layout = pb.BucketLayout(
        entries=[pb.BucketEntry(offset=0, nbytes=10), pb.BucketEntry(offset=256, nbytes=70000)]
    )
    offsets, at = places(layout, torch.device("cpu"))
    assert offsets == [0, 65536]
    assert at.tolist() == [0, 8192]  # their 8-byte words
    assert places(layout, torch.device("cpu"))[1] is at  # the same layout: kept
    again = pb.BucketLayout()
    again.CopyFrom(layout)
    assert places(again, torch.device("cpu"))[1] is not at  # another object: worked out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("skipped_row", [0, 3, None])
def test_packed_without_writing_fails_the_version_naming_rank_bucket_and_tensor(
    sock_dir, skipped_row, device
):
    # On CUDA the stamps queue behind the slot's last readers on the sender's stream.
    from weightsync.sender.daemon import Sender

    where = torch.device(device)
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1 << 20) as sender:
        model = One().to(where)
        receiver = TorchReceiver(model, sender.address, receiver_id="r")
        t, results = sync_in_thread(receiver, n=2)
        manifest = VersionManifest(1, (TensorSpec("w", "float32", (ROWS,)),))
        with Publisher(sender.address) as publisher:

            def pack(values: torch.Tensor, skip: int | None):
                def write(bucket, buffer):
                    for entry in bucket.entries:
                        pack_entry(buffer, entry, values)
                        if skip is not None:  # what it leaves as it was: one row's stamp
                            at = entry.offset + skip * 64 * 1024
                            buffer[at : at + 8] = stamped[at : at + 8]

                return write

            stamped = None
            publisher.publish_packed(
                manifest, pack(torch.ones(ROWS, device=where), None), device=where, wait=True
            )

            def lie(bucket, buffer):  # keeps one row's stamp (writes the rest), or all
                nonlocal stamped
                stamped = buffer.clone()
                if skipped_row is not None:
                    pack(torch.full((ROWS,), 2.0, device=where), skipped_row)(bucket, buffer)

            with pytest.raises(WeightSyncError) as e:
                publisher.publish_packed(manifest.at(2), lie, device=where, wait=True, timeout_s=30)
        t.join()
        receiver.close()
    offset = (skipped_row or 0) * 64 * 1024
    assert str(e.value) == (
        f"publish version 2 to {sender.address}: version 2 abandoned: publisher rank 0 "
        f"answered `packed` for bucket 0 of version 2 but "
        f"left byte {offset} of it unwritten (tensor 'w', its byte {offset}); a publisher "
        "writes every byte of its entries before `packed`"
    )
    assert torch.equal(model.w.detach().cpu(), torch.ones(ROWS))  # version 1 stays
