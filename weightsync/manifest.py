"""What one version carries: its tensors and, optionally, one LoRA adapter."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from weightsync.buckets import TensorSpec, check_manifest
from weightsync.errors import PlanError
from weightsync.limits import MAX_VERSION, check_json, quoted


@dataclass(frozen=True)
class LoraAdapterSpec:
    """A LoRA adapter shipped with a version (PEFT names and PEFT adapter config)."""

    name: str
    """The adapter name engines register it under; a new version replaces the old adapter."""
    config_json: str
    """The PEFT ``adapter_config.json`` contents (``r``, ``lora_alpha``, ``target_modules``...)."""
    tensor_names: tuple[str, ...]
    """Which manifest tensors belong to the adapter (``...lora_A.weight``/``...lora_B.weight``)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise PlanError("a LoRA adapter needs a non-empty name")
        # Bounded before parsing: deep nesting would be a RecursionError, not an error.
        check_json(self.config_json, f"LoRA adapter {quoted(self.name)}: config_json")
        try:
            json.loads(self.config_json)
        except json.JSONDecodeError as e:
            raise PlanError(f"LoRA adapter {self.name!r}: config_json is not JSON ({e})") from e

    @property
    def config(self) -> dict:
        return json.loads(self.config_json)


@dataclass(frozen=True)
class VersionPartSpec:
    """Which share of a version one sender sends, when several senders (one per trainer host)
    send one version together; receivers join the parts before they write anything."""

    index: int
    count: int
    sender_id: str
    """The sending sender (its host id), named when this part fails."""
    plan_digest: str
    """Identical in every part of one version plan (the whole name/dtype/shape list and which
    part carries each): parts that disagree are refused before any write."""
    num_tensors: int
    """Tensors in the whole version (every part together)."""

    def __post_init__(self) -> None:
        if self.count < 2 or not 0 <= self.index < self.count:
            raise PlanError(
                f"VersionPart index {self.index} of {self.count} parts: a split version has "
                "2 or more parts, indexed from 0"
            )
        if not self.sender_id or not self.plan_digest:
            raise PlanError("VersionPart needs its sender_id and the version's plan_digest")


@dataclass(frozen=True)
class VersionManifest:
    """Every tensor of one version, announced to receivers before any bucket."""

    version: int
    tensors: tuple[TensorSpec, ...]
    lora: LoraAdapterSpec | None = None
    part: VersionPartSpec | None = None
    """Set when this is one sender's share of a version split over several senders."""

    def __post_init__(self) -> None:
        _check_version(self.version)
        check_manifest(self.tensors)
        if self.lora is not None:
            names = {t.name for t in self.tensors}
            missing = [n for n in self.lora.tensor_names if n not in names]
            if missing:
                raise PlanError(
                    f"LoRA adapter {self.lora.name!r} lists {missing[0]!r}, which is not in the "
                    "manifest"
                )

    @property
    def lora_names(self) -> frozenset[str]:
        return frozenset(self.lora.tensor_names) if self.lora else frozenset()

    @cached_property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def at(self, version: int) -> VersionManifest:
        """These tensors as ``version``, without checking them again (the same list comes
        every version; checking thousands of names each time costs milliseconds)."""
        _check_version(version)
        twin = copy.copy(self)
        object.__setattr__(twin, "version", version)
        return twin


def _check_version(version: int) -> None:
    if not 1 <= version <= MAX_VERSION:
        raise PlanError(
            f"Manifest.version {version} is out of range; versions are 1..{MAX_VERSION}"
        )


def plan_digest(parts: Sequence[Sequence[TensorSpec]]) -> str:
    """The ``plan_digest`` of a version whose part ``i`` carries ``parts[i]``: every sender of
    one plan computes the same digest, so receivers can tell a stale or foreign part apart."""
    h = hashlib.sha256()
    for index, specs in enumerate(parts):
        for spec in specs:
            h.update(f"{index}\0{spec.name}\0{spec.dtype}\0{list(spec.shape)}\n".encode())
    return h.hexdigest()[:32]
