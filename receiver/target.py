"""The interface every engine adapter implements; the receiver core drives it per version."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from weightsync.errors import WeightSyncError
from weightsync.manifest import VersionManifest


class WeightTarget(Protocol):
    """Where received weights go: a torch module, a vLLM worker, an SGLang model runner.

    Call order per version: ``validate`` -> ``begin`` -> ``load`` (once per bucket) ->
    ``commit``; ``abort`` instead of ``commit`` when anything failed after ``begin``.
    """

    device: torch.device
    """Where bucket bytes should be mapped or copied before ``load``."""

    def validate(self, manifest: VersionManifest) -> None:
        """Check every name, shape and dtype against the live model before any write.

        Raises:
            NameResolutionError: a name the model lacks (the message names it).
            ManifestMismatchError: a shape or dtype differing from the live parameter.
        """

    def begin(self, manifest: VersionManifest) -> None:
        """Prepare for loading (e.g. vLLM's layerwise reload setup)."""

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load complete tensors. They may be views of a reused buffer: copy what you keep."""

    # Optional: ``load_chunk(entry: BucketEntry, data: torch.Tensor) -> None`` writes the bytes
    # of one chunk (``entry.tensor_offset``, ``entry.nbytes``) of a tensor larger than a bucket
    # in place. Targets that have it get chunks as they come instead of whole reassembled
    # tensors, which saves a full-size temporary per oversized tensor.

    def commit(self, manifest: VersionManifest) -> None:
        """Post-load processing, once, after the last bucket (register LoRA, flush caches)."""

    def abort(self, manifest: VersionManifest, error: WeightSyncError) -> None:
        """The version failed after ``begin``; leave the engine usable (weights may be dirty)."""
