"""A receiver as a catch-up source: it hands out the version it applied (what it keeps of
it: an engine rank, its boxes), bucket by bucket, into the sender's staging buffer, as a
publisher packs (``Announcement.export``; protocol §4.2). The sender asks only a receiver that
said ``exports`` and applied that version; every answer checks it still holds it, since a
version may have begun here meanwhile.
"""

from __future__ import annotations

import threading

import torch

from weightsync.buckets import pack_entry
from weightsync.errors import NameResolutionError, VersionError
from weightsync.receiver.connection import WeightsState
from weightsync.receiver.target import WeightTarget
from weightsync.regions import Region, pack_regions
from weightsync.transports.base import MappedBuffers
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import ParseCache, bucket_from_pb, error_to_pb


class Exporter:
    """Answers the sender's ``export`` requests from ``target``'s held tensors; ``lock`` is
    the one loads take, so no bucket is written while one is exported."""

    def __init__(self, target: WeightTarget, weights: WeightsState, lock: threading.Lock):
        self._target, self._weights, self._lock = target, weights, lock
        self._buffers = MappedBuffers()
        self._layouts = ParseCache(bucket_from_pb)

    def __call__(self, export: pb.PackBucket) -> pb.BucketExported:
        reply = pb.BucketExported(version=export.version, index=export.layout.index, ok=True)
        try:
            self._export(export)
        except Exception as e:
            reply.ok = False
            reply.error.CopyFrom(error_to_pb(e))
        return reply

    def _export(self, export: pb.PackBucket) -> None:
        with self._lock:
            weights = self._weights
            if weights.applying or weights.dirty or weights.applied_version != export.version:
                now = (
                    "a version being applied"
                    if weights.applying
                    else (
                        f"version {weights.applied_version}" + (" (dirty)" if weights.dirty else "")
                    )
                )
                raise VersionError(f"catch-up source holds {now}, not version {export.version}")
            bucket = self._layouts(export.layout)
            buffer = self._buffers.get(export.buffer)
            keeps = self._target.keeps()
            for entry in bucket.entries:
                tensor = self._target.held(entry.name)
                if tensor is None:
                    raise NameResolutionError(
                        f"version {export.version}: tensor {entry.name!r} is not held here as "
                        "it arrived; this receiver cannot be its catch-up source"
                    )
                box = keeps.get(entry.name)
                if box is None:
                    pack_entry(buffer, entry, tensor.detach())
                else:  # an engine rank's part: its box of the entry, the other ranks the rest
                    pack_regions(buffer, entry, [Region(box.start, tensor.detach())])
            # The sender checksums and the late receiver reads right after `exported`.
            for device in {buffer.device, self._target.device}:
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
