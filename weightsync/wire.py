"""Conversions between the in-process dataclasses and their protobuf messages."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

from weightsync.buckets import Bucket, BucketEntry, TensorSpec
from weightsync.dtypes import dtype_from_name, dtype_name
from weightsync.errors import ProtocolError
from weightsync.limits import check_manifest
from weightsync.manifest import LoraAdapterSpec, VersionManifest, VersionPartSpec
from weightsync.regions import Region
from weightsync.topology_model import Box, fits
from weightsync.v1 import weightsync_pb2 as pb


def spec_to_pb(spec: TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(name=spec.name, dtype=spec.dtype, shape=list(spec.shape))


def spec_from_pb(msg: pb.TensorSpec) -> TensorSpec:
    return TensorSpec(msg.name, msg.dtype, tuple(msg.shape))


def manifest_to_pb(manifest: VersionManifest) -> pb.Manifest:
    msg = pb.Manifest(version=manifest.version, tensors=[spec_to_pb(t) for t in manifest.tensors])
    if manifest.lora is not None:
        msg.lora.CopyFrom(
            pb.LoraAdapter(
                name=manifest.lora.name,
                config_json=manifest.lora.config_json,
                tensor_names=list(manifest.lora.tensor_names),
            )
        )
    if manifest.part is not None:
        part = manifest.part
        msg.part.CopyFrom(
            pb.VersionPart(
                index=part.index,
                count=part.count,
                sender_id=part.sender_id,
                plan_digest=part.plan_digest,
                num_tensors=part.num_tensors,
            )
        )
    return msg


def manifest_from_pb(msg: pb.Manifest) -> VersionManifest:
    """Parse a wire manifest, its fields bounded first (``limits.check_manifest``).

    Raises:
        ConfigError: a field past its bound, naming it.
        PlanError: a manifest that cannot be right (duplicate name, bad version...).
    """
    check_manifest(msg)
    lora = None
    if msg.HasField("lora"):
        lora = LoraAdapterSpec(msg.lora.name, msg.lora.config_json, tuple(msg.lora.tensor_names))
    part = None
    if msg.HasField("part"):
        p = msg.part
        part = VersionPartSpec(p.index, p.count, p.sender_id, p.plan_digest, p.num_tensors)
    return VersionManifest(msg.version, tuple(spec_from_pb(t) for t in msg.tensors), lora, part)


def bucket_to_pb(bucket: Bucket) -> pb.BucketLayout:
    return pb.BucketLayout(
        index=bucket.index,
        is_last=bucket.is_last,
        nbytes=bucket.nbytes,
        entries=[entry_to_pb(e) for e in bucket.entries],
    )


def entry_to_pb(e: BucketEntry) -> pb.BucketEntry:
    return pb.BucketEntry(
        tensor=spec_to_pb(e.spec),
        offset=e.offset,
        nbytes=e.nbytes,
        tensor_offset=e.tensor_offset,
        chunk_index=e.chunk_index,
        num_chunks=e.num_chunks,
        source=e.source,
        box_start=list(e.box_start),
    )


def bucket_from_pb(msg: pb.BucketLayout) -> Bucket:
    entries = tuple(
        BucketEntry(
            spec_from_pb(e.tensor),
            e.offset,
            e.nbytes,
            e.tensor_offset,
            e.chunk_index,
            e.num_chunks,
            e.source,
            tuple(e.box_start),
        )
        for e in msg.entries
    )
    return Bucket(msg.index, entries, msg.nbytes, msg.is_last)


def regions_to_pb(
    regions: Mapping[str, Sequence[Region]],
    locate: Callable[[torch.Tensor], tuple[int, int]],
    ready: Mapping[str, int] | None = None,
) -> list[pb.SourcePiece]:
    """Describe ``regions``; ``locate(tensor)`` gives ``(source index, storage byte offset)``,
    ``ready`` each tensor's ``SourcePiece.ready`` (default 0: written)."""
    out = []
    ready = ready or {}
    for name, parts in regions.items():
        for region in parts:
            t = region.source
            source, offset = locate(t)
            out.append(
                pb.SourcePiece(
                    name=name,
                    source=source,
                    offset=offset,
                    dtype=dtype_name(t.dtype),
                    size=list(t.shape),
                    stride=list(t.stride()),
                    dst_start=list(region.dst_start),
                    ready=ready.get(name, 0),
                )
            )
    return out


def regions_from_pb(
    pieces: Sequence[pb.SourcePiece],
    sources: Sequence[torch.Tensor],
    events: Sequence[torch.cuda.Event] = (),
) -> dict[str, list[Region]]:
    """Rebuild offered regions as views of the mapped ``sources`` (flat ``uint8``), each
    waiting for its piece's event of ``events`` (``BeginVersion.ready``, opened).

    Raises:
        ProtocolError: a piece names a missing source or event, or reaches past its source's
            end.
    """
    out: dict[str, list[Region]] = {}
    for p in pieces:
        if p.source >= len(sources):
            raise ProtocolError(f"piece of {p.name!r} names source {p.source} of {len(sources)}")
        if p.ready > len(events):
            raise ProtocolError(f"piece of {p.name!r} names ready event {p.ready} of {len(events)}")
        dtype = dtype_from_name(p.dtype)
        size, stride = tuple(p.size), tuple(p.stride)
        span = 0 if 0 in size else 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        nbytes = span * dtype.itemsize
        flat = sources[p.source]
        if p.offset + nbytes > flat.numel():
            raise ProtocolError(
                f"piece of {p.name!r} reaches byte {p.offset + nbytes} of a "
                f"{flat.numel()}-byte source"
            )
        view = flat.narrow(0, p.offset, nbytes).view(dtype).as_strided(size, stride)
        ready = events[p.ready - 1] if p.ready else None
        out.setdefault(p.name, []).append(Region(tuple(p.dst_start), view, ready))
    return out


def boxes_to_pb(boxes: Mapping[str, Box]) -> list[pb.TensorBox]:
    return [
        pb.TensorBox(name=name, start=list(box.start), size=list(box.size))
        for name, box in boxes.items()
    ]


def boxes_from_pb(
    msgs: Sequence[pb.TensorBox], specs: Mapping[str, TensorSpec], who: str
) -> dict[str, Box]:
    """The boxes ``who`` (a receiver) keeps, each checked to lie in its tensor of ``specs``.

    Raises:
        ProtocolError: naming the first box of a tensor not in the version or outside it.
    """
    boxes = {}
    for msg in msgs:
        start, size = tuple(msg.start), tuple(msg.size)
        _check_box(msg.name, start, size, specs, who)
        boxes[msg.name] = Box(start, size)
    return boxes


def check_boxes(boxes: Mapping[str, Box], specs: Mapping[str, TensorSpec], who: str) -> None:
    """:func:`boxes_from_pb`'s check of boxes ``who`` declared before, for another version's
    ``specs``."""
    for name, box in boxes.items():
        _check_box(name, box.start, box.size, specs, who)


def _check_box(
    name: str, start: tuple, size: tuple, specs: Mapping[str, TensorSpec], who: str
) -> None:
    spec = specs.get(name)
    if spec is None or not fits(start, size, spec.shape):
        shape = "not in the version" if spec is None else f"shape {list(spec.shape)}"
        raise ProtocolError(
            f"{who} declared it keeps start={list(start)} size={list(size)} of {name!r} "
            f"({shape}): not a box of that tensor; upgrade the receiver to the sender's "
            "weightsync version"
        )


def error_to_pb(error: BaseException, tensor: str = "") -> pb.ErrorDetail:
    return pb.ErrorDetail(
        code=type(error).__name__, message=str(error), tensor=tensor or getattr(error, "tensor", "")
    )


def describe(detail: pb.ErrorDetail) -> str:
    return f"{detail.code}: {detail.message}" if detail.code else detail.message


class ParseCache:
    """``parse(msg)`` memoized by key (default: the message's bytes, so an entry is never
    stale); emptied whenever it holds ``max_entries``. Layouts and manifests repeat every
    version, and converting a 339-tensor layout costs milliseconds, hashing it microseconds.
    """

    def __init__(self, parse, max_entries: int = 512) -> None:
        self._parse, self._max = parse, max_entries
        self._cache: dict[bytes, object] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._cache

    def __call__(self, msg, key: Hashable | None = None):
        key = msg.SerializeToString() if key is None else key
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= self._max:
                self._cache.clear()
            hit = self._cache[key] = self._parse(msg)
        return hit


def manifest_key(msg: pb.Manifest) -> bytes:
    """An id of the manifest without its version, which changes every time (a digest of the
    rest of its bytes: equal keys, the same tensors, LoRA adapter and part)."""
    unversioned = pb.Manifest()
    unversioned.CopyFrom(msg)
    unversioned.version = 0
    return hashlib.blake2b(unversioned.SerializeToString(), digest_size=16).digest()


class ManifestCache:
    """Parses a manifest once per tensor list (key: :func:`manifest_key`, which leaves out the
    version, the one field that changes between versions); emptied whenever it holds 16."""

    def __init__(self, max_entries: int = 16) -> None:
        self._parsed = ParseCache(manifest_from_pb, max_entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._parsed

    def __call__(self, msg: pb.Manifest, key: bytes = b"") -> tuple[VersionManifest, bytes]:
        """The manifest and its key: ``key`` where the sender gave one (its
        :func:`manifest_key`, ``VersionStart.manifest_key``), else worked out here."""
        key = key or manifest_key(msg)
        return self._parsed(msg, key=key).at(msg.version), key
