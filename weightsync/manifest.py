"""What one version carries: its tensors and, optionally, one LoRA adapter."""

from __future__ import annotations

import json
from dataclasses import dataclass

from weightsync.buckets import TensorSpec, check_manifest
from weightsync.errors import PlanError


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
        try:
            json.loads(self.config_json)
        except json.JSONDecodeError as e:
            raise PlanError(f"LoRA adapter {self.name!r}: config_json is not JSON ({e})") from e

    @property
    def config(self) -> dict:
        return json.loads(self.config_json)


@dataclass(frozen=True)
class VersionManifest:
    """Every tensor of one version, announced to receivers before any bucket."""

    version: int
    tensors: tuple[TensorSpec, ...]
    lora: LoraAdapterSpec | None = None

    def __post_init__(self) -> None:
        if self.version < 1:
            raise PlanError(f"version must be >= 1, got {self.version}")
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

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)
