"""``TorchReceiver``: receive into a plain ``torch.nn.Module`` (e.g. a transformers model)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from weightsync.receiver.core import ReceiverCore

from weightsync.buckets import BucketEntry, byte_view
from weightsync.dtypes import dtype_name
from weightsync.errors import ManifestMismatchError, NameResolutionError, WeightSyncError
from weightsync.manifest import VersionManifest

_LISTED = 5


class TorchModuleTarget:
    """Loads tensors by ``state_dict`` name, in place (parameters and persistent buffers)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.live = dict(module.state_dict(keep_vars=True))
        first = next(iter(self.live.values()), None)
        self.device = first.device if first is not None else torch.device("cpu")

    def validate(self, manifest: VersionManifest) -> None:
        missing = [t.name for t in manifest.tensors if t.name not in self.live]
        if missing:
            near = ", ".join(sorted(self.live)[:_LISTED])
            raise NameResolutionError(
                f"version {manifest.version}: {len(missing)} tensor(s) the module lacks, first "
                f"{missing[0]!r} (all: {missing[:_LISTED]}); the module has e.g. {near}. Publish "
                "names as in the module's state_dict()"
            )
        for spec in manifest.tensors:
            live = self.live[spec.name]
            if tuple(live.shape) != spec.shape or live.dtype != spec.torch_dtype:
                raise ManifestMismatchError(
                    f"version {manifest.version}: tensor {spec.name!r} is {spec.shape} "
                    f"{spec.dtype} but the module holds {tuple(live.shape)} "
                    f"{dtype_name(live.dtype)}"
                )

    def begin(self, manifest: VersionManifest) -> None:
        pass

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in tensors:
                self.live[name].copy_(tensor, non_blocking=True)

    def load_chunk(self, entry: BucketEntry, data: torch.Tensor) -> None:
        with torch.no_grad():
            live = byte_view(self.live[entry.name].data)
            live[entry.tensor_offset : entry.tensor_offset + entry.nbytes].copy_(
                data, non_blocking=True
            )

    def commit(self, manifest: VersionManifest) -> None:
        pass

    def abort(self, manifest: VersionManifest, error: WeightSyncError) -> None:
        pass


class TorchReceiver(ReceiverCore):
    """A receiver for a plain torch module; see :class:`ReceiverCore` for ``sync()``.

    Example::

        receiver = TorchReceiver(model, "unix:/tmp/weightsync.sock")
        version = receiver.sync()   # blocks until the next version is applied
    """

    def __init__(self, model: torch.nn.Module, address: str, **kwargs) -> None:
        kwargs.setdefault("engine", "torch")
        super().__init__(TorchModuleTarget(model), address, **kwargs)
