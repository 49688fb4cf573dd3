"""LoRA tensors of a version, copied out of reused bucket buffers until the final bucket.

Shared by every engine adapter: the engines differ in how they register an adapter, not in
how its tensors are collected.
"""

from __future__ import annotations

import torch

from weightsync.errors import ProtocolError
from weightsync.manifest import LoraAdapterSpec


class LoraAccumulator:
    """Copies one adapter's tensors out of reused bucket buffers until all have arrived."""

    def __init__(self, spec: LoraAdapterSpec) -> None:
        self.spec = spec
        self._wanted = frozenset(spec.tensor_names)
        self._tensors: dict[str, torch.Tensor] = {}

    def wants(self, name: str) -> bool:
        return name in self._wanted

    def add(self, name: str, tensor: torch.Tensor) -> None:
        # The bucket is reused for the next one, and vLLM scales lora_b in place: own a copy.
        self._tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()

    def complete(self) -> tuple[LoraAdapterSpec, dict[str, torch.Tensor]]:
        missing = sorted(self._wanted - self._tensors.keys())
        if missing:
            raise ProtocolError(
                f"LoRA adapter {self.spec.name!r}: the version ended without {missing[:5]}"
            )
        return self.spec, self._tensors
