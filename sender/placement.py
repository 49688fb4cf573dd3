"""What a publisher worked out for the tensors it published last, and when it still holds."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from weightsync.blocked_copies import CheckedPacks
from weightsync.buckets import TensorSpec
from weightsync.errors import ConfigError
from weightsync.manifest import LoraAdapterSpec, VersionManifest, VersionPartSpec
from weightsync.regions import whole
from weightsync.tensor_keys import SameTensors, layout_key
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import manifest_to_pb


@dataclass
class Published:
    """What :meth:`Publisher.publish` worked out for a mapping of tensors."""

    mapping: Mapping[str, torch.Tensor] | None
    """The caller's mapping, if it gave one."""
    tensors: dict[str, torch.Tensor]
    key: tuple
    """:func:`~weightsync.tensor_keys.layout_key` of ``tensors``."""
    lora: LoraAdapterSpec | None
    part: VersionPartSpec | None
    manifest: VersionManifest
    regions: dict
    packs: CheckedPacks = field(default_factory=CheckedPacks)
    """This publisher's own packs of CPU buckets from these tensors (planned once each, and
    dropped with them)."""

    def __post_init__(self) -> None:
        self._same = SameTensors(self.mapping) if self.mapping is not None else None
        self.gpus = frozenset(t.device for t in self.tensors.values() if t.is_cuda)
        """The GPUs the tensors are on (whose streams a publish waits for)."""

    def same_tensors(self, mapping: object) -> bool:
        """Whether ``mapping`` is the one published, still holding the same tensors where
        they were (:class:`~weightsync.tensor_keys.SameTensors`)."""
        return self._same is not None and self._same.holds(mapping)


def placed(
    last: Published | None,
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    lora: LoraAdapterSpec | None,
    part: VersionPartSpec | None,
    version: int,
) -> Published:
    """The manifest and regions of ``named_tensors``: ``last``'s while they still describe
    them (see :meth:`Publisher.publish`)."""
    mapping = named_tensors if isinstance(named_tensors, Mapping) else None
    if (
        last is not None
        and (last.lora, last.part) == (lora, part)
        and last.same_tensors(named_tensors)
    ):
        return last
    tensors = dict(named_tensors.items() if mapping is not None else named_tensors)
    key = layout_key(tensors)
    if last is None or (last.key, last.lora, last.part) != (key, lora, part):
        specs = tuple(TensorSpec.of(n, t) for n, t in tensors.items())
        manifest, regions = VersionManifest(version, specs, lora, part), whole(tensors)
    else:
        manifest, regions = last.manifest, last.regions
    return Published(mapping, tensors, key, lora, part, manifest, regions)


class ReadyCheck:
    """That a publish's ``ready`` names every tensor it offers, looked at once per pair of
    (tensors, events) objects, by identity: a MoE model's thousands of names are not walked
    every version (and tensors are never compared by value)."""

    def __init__(self) -> None:
        self._last: tuple[object, object] | None = None

    def __call__(
        self, tensors: object, names: Iterable[str], ready: Mapping | None, version: int
    ) -> None:
        last = self._last
        if ready is None or (last is not None and last[0] is tensors and last[1] is ready):
            return
        missing = next((name for name in names if name not in ready), None)
        if missing is not None:
            raise ConfigError(
                f"publish version {version}: `ready` names no event for {missing!r}; "
                "name every tensor (one event may serve many)"
            )
        self._last = (tensors, ready)


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
