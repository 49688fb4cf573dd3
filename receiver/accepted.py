"""What a receiver's target last accepted, so a version like the last is not checked again:
manifests parsed by key, the (tensor list, target generation) last validated, and the boxes
the target keeps of each manifest (declared to the sender in the verdict)."""

from __future__ import annotations

from weightsync.exports import Exports
from weightsync.manifest import VersionManifest
from weightsync.memo import Memo
from weightsync.receiver.connection import Keeps
from weightsync.receiver.links import Link
from weightsync.receiver.target import WeightTarget
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import ManifestCache, boxes_to_pb

_KEPT_MANIFESTS = 16


class Accepted:
    """Shared by the single-sender path (:mod:`.core`) and the several-senders one
    (:mod:`.several_senders`); the target is passed in, as the core's may be replaced."""

    def __init__(self, receiver_id: str) -> None:
        self._manifests = ManifestCache()
        self._validated: tuple[bytes, int] | None = None
        """(manifest key, target generation) the target last accepted: the same tensor list
        for the same model need not be checked again."""
        self._keeps: Memo[tuple[bytes, int], Keeps] = Memo(_KEPT_MANIFESTS)
        self._writes: Memo[tuple[bytes, int], pb.WriteOffer | None] = Memo(_KEPT_MANIFESTS)
        self._exports = Exports(
            f"receiver {receiver_id}",
            "the sender does not write its weights: it loads every bucket",
        )
        """The weights' storages offered to the sender (kept exported while offered)."""

    def manifest(self, link: Link, start: pb.VersionStart) -> tuple[VersionManifest, bytes]:
        """The version's manifest and its key; a manifest sent by key alone is taken from the
        stream's copy only when the cache let it go. Parsing bounds every field too: a
        manifest past a bound is rejected like one that does not fit the model.

        Raises:
            ProtocolError: sent by a key the stream does not hold.
        """
        msg = start.manifest
        if start.manifest_key and not msg.tensors and start.manifest_key not in self._manifests:
            msg = link.manifest(start)
        return self._manifests(msg, start.manifest_key)

    def validate(self, target: WeightTarget, manifest: VersionManifest, key: bytes) -> None:
        """``target.validate(manifest)``, unless it accepted this tensor list last."""
        validated = (key, target.generation)
        if validated != self._validated:
            target.validate(manifest)
            self._validated = validated

    def keeps(self, target: WeightTarget, manifest: VersionManifest, key: bytes) -> Keeps:
        """The boxes of ``manifest``'s tensors ``target`` keeps (after validating), declared
        in the verdict so the sender plans this receiver's bytes, keyed by the manifest and
        generation they are worked out from (the stream then sends the key alone)."""

        def keeps() -> Keeps:
            kept = target.keeps()
            names = {spec.name for spec in manifest.tensors} if kept else set()
            boxes = boxes_to_pb({n: b for n, b in kept.items() if n in names})
            return Keeps(boxes, _stream_key(key, target))

        return self._keeps.get((key, target.generation), keeps)

    def writes(
        self, target: WeightTarget, manifest: VersionManifest, key: bytes
    ) -> pb.WriteOffer | None:
        """Where the sender may write ``manifest``'s tensors into ``target``
        (:meth:`~.WeightTarget.write_regions`, after validating and :meth:`keeps`), keyed
        like the boxes; None where the target loads every bucket itself."""

        def offer() -> pb.WriteOffer | None:
            regions = target.write_regions(manifest)
            if regions is None:
                return None
            begin = self._exports.offer(regions)
            if begin is None:
                return None
            return pb.WriteOffer(
                key=b"w" + _stream_key(key, target), sources=begin.sources, pieces=begin.pieces
            )

        return self._writes.get((key, target.generation), offer)


def _stream_key(key: bytes, target: WeightTarget) -> bytes:
    """What the manifest ``key`` and the target's generation are sent as (protocol §2.1)."""
    return key + target.generation.to_bytes(8, "little")
