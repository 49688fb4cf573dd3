"""``TorchReceiver``: receive into a plain ``torch.nn.Module`` or a transformers model.

A plain module takes versions named as in its ``state_dict``. A transformers 5 model takes
versions named as its CHECKPOINT on disk: transformers keeps some weights in another layout
than it saves (MoE experts fused into ``experts.gate_up_proj``, renamed legacy keys), and
loads checkpoints through its own conversion (``WeightConverter`` / ``WeightRenaming``). The
receiver runs that same conversion, so a version lands exactly as ``from_pretrained`` would
load the same tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from weightsync.errors import ManifestMismatchError, NameResolutionError, WeightSyncError
from weightsync.manifest import VersionManifest
from weightsync.receiver.core import ReceiverCore
from weightsync.receiver.target import Arrival, InPlaceTarget, WeightTarget

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


def checkpoint_conversions(model: torch.nn.Module) -> list[Any]:
    """transformers' load-time conversions for ``model`` (empty: not a transformers model, or
    one whose checkpoint layout is its live layout)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    return list(get_model_conversion_mapping(model))


@contextlib.contextmanager
def _writes_to(write: Any) -> Iterator[None]:
    """transformers' loader with its last step, setting a converted tensor on the model,
    replaced by ``write(model, target_name, value, loading_info)``.

    transformers REPLACES parameters (``setattr``); a receiver must write in place, since
    optimizers, engines and tied modules hold the live tensors.
    """
    from transformers import core_model_loading

    original = core_model_loading.set_param_for_module

    def set_param(model, target_name, value, loading_info, hf_quantizer):  # noqa: ANN001
        loading_info.missing_keys.discard(target_name)
        write(model, target_name, value)

    core_model_loading.set_param_for_module = set_param
    try:
        yield
    finally:
        core_model_loading.set_param_for_module = original


def _convert_and_load(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], device: torch.device, write: Any
) -> Any:
    """transformers' own checkpoint-to-live conversion of ``tensors``, written by ``write``."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    config = LoadStateDictConfig(
        weight_mapping=checkpoint_conversions(model), device_map={"": device}
    )
    with _writes_to(write), torch.no_grad():
        info, _ = convert_and_load_state_dict_in_model(model, tensors, config)
    return info


class TransformersTarget(WeightTarget):
    """A transformers model that takes versions named as its checkpoint on disk.

    ``validate`` checks every name, shape and dtype against the checkpoint layout transformers
    saves for this model (its own ``revert_weight_conversion`` of the live weights, on meta),
    then converts meta tensors of the manifest the way ``from_pretrained`` would, so a fused
    tensor missing some of its sources (a partial MoE layer) is refused before any write.
    Tensors whose checkpoint name is a live name are written in place as they arrive; the
    others are kept until ``commit`` converts and writes them.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers.core_model_loading import revert_weight_conversion

        self.model = model
        self.live = dict(model.state_dict(keep_vars=True))
        first = next(iter(self.live.values()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        meta = {name: t.detach().to("meta") for name, t in self.live.items()}
        self.checkpoint = revert_weight_conversion(model, meta)
        self._direct: set[str] = set()
        self._pending: dict[str, torch.Tensor] = {}

    def validate(self, manifest: VersionManifest) -> None:
        # Live (state_dict) names are still taken as they are: senders that publish the
        # in-memory layout keep working.
        unknown = [
            t.name for t in manifest.tensors if t.name not in self.checkpoint | self.live.keys()
        ]
        if unknown:
            near = ", ".join(sorted(self.checkpoint)[:_LISTED])
            raise NameResolutionError(
                f"version {manifest.version}: {len(unknown)} tensor(s) that "
                f"{type(self.model).__name__}'s checkpoint lacks, first {unknown[0]!r} (all: "
                f"{unknown[:_LISTED]}); its checkpoint has e.g. {near}. Publish the names "
                "save_pretrained writes"
            )
        for spec in manifest.tensors:
            want = self.live.get(spec.name, self.checkpoint.get(spec.name))
            if tuple(want.shape) != spec.shape or want.dtype != spec.torch_dtype:
                raise ManifestMismatchError(
                    f"version {manifest.version}: tensor {spec.name!r} is {spec.shape} "
                    f"{spec.dtype} but the model loads {tuple(want.shape)} {want.dtype}"
                )
        converted = {
            s.name: torch.empty(s.shape, dtype=s.torch_dtype, device="meta")
            for s in manifest.tensors
            if s.name not in self.live
        }
        if converted:
            self._check_conversion(manifest.version, converted)
        self._direct = {s.name for s in manifest.tensors if s.name in self.live}

    def _check_conversion(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        def check(model: torch.nn.Module, target: str, value: torch.Tensor) -> None:
            live = self.live[target]
            if value.shape != live.shape:
                raise ManifestMismatchError(
                    f"version {version}: the checkpoint tensors for {target!r} convert to "
                    f"{tuple(value.shape)} but the model holds {tuple(live.shape)}"
                )

        info = _convert_and_load(self.model, tensors, torch.device("meta"), check)
        if info.conversion_errors:
            target, error = next(iter(info.conversion_errors.items()))
            reason = error.strip().splitlines()[-1]
            raise ManifestMismatchError(
                f"version {version}: {target!r} cannot be converted from the version's "
                f"tensors ({reason}); a fused tensor needs all its checkpoint tensors (every "
                "expert of the layer) in one version"
            )
        if info.unexpected_keys:
            raise NameResolutionError(
                f"version {version}: transformers loads nothing for "
                f"{sorted(info.unexpected_keys)[:_LISTED]}"
            )

    def begin(self, manifest: VersionManifest) -> None:
        self._pending = {}

    def load(self, arrival: Arrival | Iterable[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in (t for group, _ in Arrival.of(arrival).whole() for t in group):
                if name in self._direct:
                    self.live[name].copy_(tensor)
                else:
                    self._pending[name] = tensor.clone()  # the bucket buffer is reused

    def commit(self, manifest: VersionManifest) -> None:
        pending, self._pending = self._pending, {}
        if not pending:
            return

        def write(model: torch.nn.Module, target: str, value: torch.Tensor) -> None:
            self.live[target].copy_(value)

        _convert_and_load(self.model, pending, self.device, write)

    def abort(self, manifest: VersionManifest, error: WeightSyncError) -> None:
        self._pending = {}


def torch_target(model: torch.nn.Module) -> WeightTarget:
    """:class:`TransformersTarget` for a transformers model whose checkpoint layout differs
    from its live one, else :class:`TorchModuleTarget`."""
    return TransformersTarget(model) if checkpoint_conversions(model) else TorchModuleTarget(model)


class TorchReceiver(ReceiverCore):
    """A receiver for a torch module; see :class:`ReceiverCore` for ``sync()``.

    A transformers model takes versions named as its checkpoint on disk (see the module
    docstring); any other module takes its ``state_dict`` names.

    Example::

        receiver = TorchReceiver(model, "unix:/tmp/weightsync.sock")
        version = receiver.sync()   # blocks until the next version is applied

    With one sender per trainer host, pass every sender's address: each version then comes
    split over them and is committed once, when every part arrived intact::

        receiver = TorchReceiver(model, ["trainer-a:7000", "trainer-b:7000"])
    """

    def __init__(self, model: torch.nn.Module, address: str | Sequence[str], **kwargs) -> None:
        kwargs.setdefault("engine", "torch")
        super().__init__(torch_target(model), address, **kwargs)
