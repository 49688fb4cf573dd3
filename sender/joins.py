"""Publisher ranks joining a version: what a stream's begin stands for and where the version
is staged; and how a begin or a receiver's hello is refused."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from weightsync.errors import ConfigError, WeightSyncError
from weightsync.manifest import VersionManifest
from weightsync.sender.hellos import check_manifest_not_empty
from weightsync.sender.offer import rank_offer
from weightsync.sender.records import RankConn
from weightsync.stream_keys import KeptByKey
from weightsync.transports.cuda_ipc import local_index_of
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import ManifestCache

log = logging.getLogger("weightsync.sender")


@dataclass
class KeptBegin:
    """A begin that carried its contents, and what the sender worked out of it once."""

    begin: pb.BeginVersion
    manifest: VersionManifest
    manifest_key: bytes
    offer: bytes


class StreamBegins:
    """The begins a publisher rank's stream sent with their contents, by ``begin_key``: one
    sent by key alone stands for its kept one (a large model's begin is costly to send, parse
    and key every version)."""

    def __init__(self) -> None:
        self._kept: KeptByKey[KeptBegin] = KeptByKey("begin_key")
        self.received: tuple = ()
        """The mappings of the shm sources that came with the begin taken next."""
        self.files: tuple = ()
        """Those of the last begin with contents, held while its version packs and while its
        key may stand for it. An older kept begin's files stay mapped only while a cached
        offer or a kept version holds them (else the publisher packs): keeping every kept
        begin's would hold up to 16 of a publisher's discarded buffers."""

    def take(
        self, begin: pb.BeginVersion, device_uuid: str, manifests: ManifestCache
    ) -> tuple[VersionManifest, KeptBegin]:
        """The manifest ``begin`` stands for, at its version, and the begin with contents it
        is or stands for (kept under its key).

        Raises:
            ProtocolError: sent by a key this stream holds nothing under.
        """
        received, self.received = self.received, ()
        version = begin.manifest.version
        if begin.begin_key and not begin.manifest.tensors:  # never empty: by key alone
            kept = self._kept.held(begin.begin_key, f"BeginVersion of version {version}")
            return kept.manifest.at(version), kept
        check_manifest_not_empty(begin.manifest)
        manifest, key = manifests(begin.manifest)  # bounds every field
        kept = KeptBegin(begin, manifest, key, rank_offer(begin, device_uuid))
        self.files = received
        if begin.begin_key:
            self._kept.keep(begin.begin_key, kept)
        return manifest, kept


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
