"""``TorchReceiver``: receive into a plain ``torch.nn.Module`` (e.g. a transformers model)."""

from __future__ import annotations

import torch

from weightsync.errors import NameResolutionError
from weightsync.manifest import VersionManifest
from weightsync.receiver.core import ReceiverCore
from weightsync.receiver.target import InPlaceTarget

_LISTED = 5


class TorchModuleTarget(InPlaceTarget):
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
        self.check_shapes(manifest)

    def live_tensor(self, name: str) -> torch.Tensor:
        return self.live[name]


class TorchReceiver(ReceiverCore):
    """A receiver for a plain torch module; see :class:`ReceiverCore` for ``sync()``.

    Example::

        receiver = TorchReceiver(model, "unix:/tmp/weightsync.sock")
        version = receiver.sync()   # blocks until the next version is applied
    """

    def __init__(self, model: torch.nn.Module, address: str, **kwargs) -> None:
        kwargs.setdefault("engine", "torch")
        super().__init__(TorchModuleTarget(model), address, **kwargs)
