"""Publisher ranks joining a version: what a stream's begin stands for and where the version
is staged; and how a begin or a receiver's hello is refused."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from weightsync.errors import ConfigError, ProtocolError, WeightSyncError
from weightsync.manifest import VersionManifest
from weightsync.sender.hellos import check_manifest_not_empty
from weightsync.sender.offer import rank_offer
from weightsync.sender.records import RankConn
from weightsync.transports.cuda_ipc import local_index_of
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import ManifestCache

log = logging.getLogger("weightsync.sender")


@dataclass
class StreamBegin:
    """The last begin on a publisher rank's stream that carried its manifest and offer, and
    what the sender worked out of it once: a ``BeginVersion.repeat`` stands for it (a large
    model's begin is costly to send, parse and key every version)."""

    begin: pb.BeginVersion | None = None
    manifest: VersionManifest | None = None
    manifest_key: bytes = b""
    offer: bytes = b""
    received: tuple = ()
    """The mappings of the shm sources that came with the begin taken next
    (``packing.received_sources``)."""
    files: tuple = ()
    """Those of :attr:`begin`, held while a repeat may stand for it."""

    def take(
        self, begin: pb.BeginVersion, device_uuid: str, manifests: ManifestCache
    ) -> VersionManifest:
        """The manifest ``begin`` stands for; a whole begin becomes the stream's last."""
        received, self.received = self.received, ()
        if begin.repeat:
            if self.manifest is None:
                raise ProtocolError(
                    f"BeginVersion of version {begin.manifest.version} repeats the last begin "
                    "on this stream, but no begin on it carried a manifest yet; send it whole"
                )
            return self.manifest.at(begin.manifest.version)
        check_manifest_not_empty(begin.manifest)
        manifest, self.manifest_key = manifests(begin.manifest)  # bounds every field
        self.begin, self.manifest, self.files = begin, manifest, received
        self.offer = rank_offer(begin, device_uuid)
        return manifest


def staging_device(rank: RankConn) -> torch.device:
    """Where rank 0's tensors live, as this process numbers GPUs (by UUID, since the trainer
    and the sender may see different ``CUDA_VISIBLE_DEVICES``)."""
    device = torch.device(rank.device)
    if device.type != "cuda" or not rank.device_uuid:
        return device
    return torch.device("cuda", local_index_of(rank.device_uuid, device.index or 0))


@contextmanager
def refused(what: str, check: str) -> Iterator[None]:
    """Our errors pass; any other exception (a bug, or input no check foresaw) becomes a
    ConfigError, INVALID_ARGUMENT for the caller, saying ``what`` failed and which fields to
    ``check``; its traceback goes to the log."""
    try:
        yield
    except WeightSyncError:
        raise
    except Exception as e:
        log.exception("refused: %s", what)
        raise ConfigError(f"{what}: {type(e).__name__}: {e}; check {check}") from e
