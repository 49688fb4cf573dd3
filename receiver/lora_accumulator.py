"""LoRA tensors of a version: which names an adapter may carry, and collecting its tensors
out of reused bucket buffers until the final bucket.

Shared by every engine adapter: the engines differ in how they register an adapter, not in
how its tensors are checked and collected.
"""

from __future__ import annotations

import torch

from weightsync.errors import ManifestMismatchError, ProtocolError
from weightsync.manifest import LoraAdapterSpec

MAX_ADAPTER_NAME_BYTES = 200
"""Engines store an adapter under its name, and vLLM's copy as ``.<name>.v<version>`` (up to 23
bytes more): 200 keeps every such file name within Linux's 255-byte limit, so a name that passes
here cannot fail at commit, after the base weights were written."""


def check_adapter(spec: LoraAdapterSpec) -> None:
    """Everything an engine checks of an adapter before a version writes anything."""
    check_adapter_name(spec.name)
    check_peft_names(spec)


def check_adapter_name(name: str, error: type[Exception] = ManifestMismatchError) -> None:
    """Reject a name that is not one plain file name (engines make it a path)."""
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        size = -1
    if size < 0:
        problem = "is not valid UTF-8"
    elif not name:
        problem = "is empty"
    elif "\0" in name or "/" in name or "\\" in name:
        problem = "contains a NUL or a path separator"
    elif name.startswith("."):
        problem = "starts with '.' (., .. and hidden names are not adapter names)"
    elif size > MAX_ADAPTER_NAME_BYTES:
        problem = f"is {size} bytes long, over {MAX_ADAPTER_NAME_BYTES}"
    else:
        return
    raise error(f"LoRA adapter name {name!r} {problem}; it must be a plain file name")


def check_peft_names(spec: LoraAdapterSpec) -> None:
    """Reject an adapter carrying a tensor that is not a PEFT ``lora_A``/``lora_B`` weight."""
    bad = [n for n in spec.tensor_names if not _is_lora_weight(n)]
    if bad:
        raise ManifestMismatchError(
            f"LoRA adapter {spec.name!r}: {bad[0]!r} is not a PEFT lora_A/lora_B weight"
        )


def _is_lora_weight(name: str) -> bool:
    return name.endswith((".lora_A.weight", ".lora_B.weight")) or ".lora_embedding_" in name


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
