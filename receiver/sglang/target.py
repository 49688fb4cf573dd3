"""``SglangWeightTarget``: load received tensors into an SGLang model (one TP worker's).

Per version: ``validate`` dry-runs the model's own ``load_weights`` on meta tensors, which
tells where every name lands and checks it with each parameter's own loader (nothing
written); ``begin`` undoes in-place
quantization packing; ``load`` hands each bucket to the model's own ``load_weights`` (its
name mapping, packed qkv/gate_up slices, fused experts, TP slicing); ``commit`` runs the
model's post-load fix-ups and quantization processing once, then loads the LoRA adapter
accumulated across buckets through SGLang's tensor adapter loading.

SGLang's ``load_weights`` skips names it does not know without a word; that is why nothing
reaches it before ``validate`` has resolved every name.

Tested with SGLang 0.5.23 (model classes built on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from weightsync.errors import ManifestMismatchError, WeightSyncError
from weightsync.manifest import LoraAdapterSpec, VersionManifest
from weightsync.receiver.lora_accumulator import LoraAccumulator, check_adapter
from weightsync.receiver.name_resolver import ResolvedName, resolve_by_loading
from weightsync.receiver.sglang.sglang_resolver import check_expert_shapes
from weightsync.receiver.target import WeightTarget


class LoraLoader(Protocol):
    """Where a completed adapter goes (e.g. :class:`~.lora_loader.SglangLoraLoader`)."""

    def validate(self, spec: LoraAdapterSpec) -> None:
        """Reject an adapter the engine cannot serve, before any write."""

    def load(self, spec: LoraAdapterSpec, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load the adapter, replacing the previous adapter of the same name."""


class SglangWeightTarget(WeightTarget):
    """A :class:`~weightsync.receiver.target.WeightTarget` for an SGLang model.

    Args:
        model: the live model (``model_runner.model``).
        device: where buckets are mapped (the worker's device).
        lora_loader: where adapters go; None when the engine runs without LoRA.
        process_quantized: undo quantization packing in ``begin`` and redo it in ``commit``
            (SGLang's ``restore_weights_before_loading`` / ``postprocess_weights``). Pass False
            when SGLang's own ``begin_weight_update``/``end_weight_update`` session already
            does this around the load (the ``update_weights_from_tensor`` hook).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device | str,
        *,
        lora_loader: LoraLoader | None = None,
        process_quantized: bool = True,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.lora_loader = lora_loader
        self.process_quantized = process_quantized
        # What validate found, reused by every version until the core validates again (a new
        # tensor list).
        self._resolved: dict[str, ResolvedName] = {}
        self._lora: LoraAccumulator | None = None
        self._held: dict[str, torch.Tensor] = {}
        self._restored = False

    # -- WeightTarget -------------------------------------------------------------------

    def validate(self, manifest: VersionManifest) -> None:
        if manifest.lora is not None:
            self._validate_lora(manifest.lora, manifest.version)
        lora_names = manifest.lora_names
        base = [spec for spec in manifest.tensors if spec.name not in lora_names]
        resolved = resolve_by_loading(self.model, base)
        check_expert_shapes(self.model, base, resolved)
        self._resolved = resolved

    def _validate_lora(self, spec: LoraAdapterSpec, version: int) -> None:
        if self.lora_loader is None:
            raise ManifestMismatchError(
                f"version {version} carries LoRA adapter {spec.name!r} but this SGLang "
                "target has no LoRA loader: build it with target_from_model_runner on a server "
                "launched with --enable-lora (and --max-lora-rank, --lora-target-modules)"
            )
        check_adapter(spec)
        self.lora_loader.validate(spec)

    def begin(self, manifest: VersionManifest) -> None:
        self._lora = LoraAccumulator(manifest.lora) if manifest.lora is not None else None
        self._held = {}
        if self.process_quantized and self._resolved:
            from sglang.srt.model_loader.loader import DefaultModelLoader

            DefaultModelLoader.restore_weights_before_loading(self.model, self.device)
            self._restored = True

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        base: list[tuple[str, torch.Tensor]] = []
        for name, tensor in tensors:
            if self._lora is not None and self._lora.wants(name):
                self._lora.add(name, tensor)  # copied out: the bucket buffer is reused
            elif name not in self._resolved:
                raise ManifestMismatchError(
                    f"{name!r} arrived in a bucket but the validated manifest does not list it"
                )
            elif self._resolved[name].loaded_with:
                base.extend(self._with_partners(name, tensor))
            else:
                base.append((name, tensor))
        if base:
            # Weight loaders copy into the live parameters, so bucket views need no copy.
            with torch.no_grad():
                self.model.load_weights(iter(base))

    def _with_partners(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Names the model loads in one call reach one ``load_weights`` together (its cache
        of the first lives only for that call); kept until the last of them arrives."""
        self._held[name] = tensor.clone()  # the bucket buffer is reused
        group = self._resolved[name].loaded_with | {name}
        if not group <= self._held.keys():
            return []
        return [(n, self._held.pop(n)) for n in sorted(group)]

    def commit(self, manifest: VersionManifest) -> None:
        # Derived weights (e.g. DeepSeek's absorbed MLA matrices) need every input in place.
        post_load = getattr(self.model, "post_load_weights", None)
        if callable(post_load) and self._resolved:
            post_load()
        self._finish_quantized()
        lora, self._lora = self._lora, None
        if lora is not None and self.lora_loader is not None:
            spec, tensors = lora.complete()
            self.lora_loader.load(spec, tensors, manifest.version)

    def abort(self, manifest: VersionManifest, error: WeightSyncError) -> None:
        # Re-pack what begin unpacked so the engine can keep serving (possibly dirty) weights.
        self._finish_quantized()
        self._lora = None

    def _finish_quantized(self) -> None:
        if not self._restored:
            return
        self._restored = False
        from sglang.srt.model_loader.loader import DefaultModelLoader

        DefaultModelLoader.postprocess_weights(self.model, self.device)


def target_from_model_runner(model_runner: Any, **kwargs: Any) -> SglangWeightTarget:
    """Build the target from an SGLang ``ModelRunner`` (inside a TP worker).

    LoRA goes through the runner's ``lora_manager`` when the server runs with ``--enable-lora``.
    """
    from weightsync.receiver.sglang.lora_loader import SglangLoraLoader

    lora_manager = getattr(model_runner, "lora_manager", None)
    kwargs.setdefault("lora_loader", SglangLoraLoader(lora_manager) if lora_manager else None)
    return SglangWeightTarget(model_runner.model, model_runner.device, **kwargs)
