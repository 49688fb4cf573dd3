"""What a publisher worked out for the tensors it published last, and when it still holds."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter, is_

import torch

from weightsync.manifest import LoraAdapterSpec, VersionManifest, VersionPartSpec
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import manifest_to_pb


def placement_key(tensors: Mapping[str, torch.Tensor]) -> tuple:
    """Equal while last version's specs and regions still describe ``tensors``: every name,
    dtype, shape, address and stride. Built a field at a time over all tensors (a tuple per
    tensor cost several times more), with strides only of tensors not contiguous (a shape
    decides a contiguous tensor's addressing, and ``stride()`` is slow)."""
    values = list(tensors.values())
    contiguous = tuple(map(torch.Tensor.is_contiguous, values))
    return (
        tuple(tensors),
        tuple(map(attrgetter("dtype"), values)),
        tuple(map(attrgetter("shape"), values)),
        tuple(map(torch.Tensor.data_ptr, values)),
        contiguous,
        tuple(t.stride() for t, c in zip(values, contiguous, strict=True) if not c),
    )


@dataclass
class Published:
    """What :meth:`Publisher.publish` worked out for a mapping of tensors."""

    mapping: Mapping[str, torch.Tensor] | None
    """The caller's mapping (held, so its identity is never another's)."""
    tensors: dict[str, torch.Tensor]
    key: tuple
    """:func:`placement_key` of ``tensors``."""
    lora: LoraAdapterSpec | None
    part: VersionPartSpec | None
    manifest: VersionManifest
    regions: dict

    def __post_init__(self) -> None:
        self._names = tuple(self.tensors)
        self._values = tuple(self.tensors.values())
        self._addresses = tuple(map(torch.Tensor.data_ptr, self._values))

    def same_tensors(self) -> bool:
        """Whether ``mapping`` still holds the same tensor objects under the same names, at
        the same addresses (a tensor given new memory by ``.data =`` shows there)."""
        values = tuple(self.mapping.values())
        return (
            tuple(self.mapping) == self._names  # as many values as last time, too
            and all(map(is_, values, self._values))
            and tuple(map(torch.Tensor.data_ptr, values)) == self._addresses
        )


class WireManifest:
    """The last manifest on the wire, converted again only for another tensor list (by
    identity: the callers keep theirs; holding it here keeps the identity meaningful) or
    another LoRA spec or part."""

    def __init__(self) -> None:
        self._last: tuple[VersionManifest, pb.Manifest] | None = None

    def __call__(self, manifest: VersionManifest) -> pb.Manifest:
        last = self._last
        if last is None or (
            last[0].tensors is not manifest.tensors
            or last[0].lora != manifest.lora
            or last[0].part != manifest.part
        ):
            self._last = last = (manifest, manifest_to_pb(manifest))
        return last[1]
