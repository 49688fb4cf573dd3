"""``SglangWeightTarget``: load received tensors into an SGLang model (one TP worker's).

Per version: ``validate`` dry-runs the model's own ``load_weights`` on meta tensors, which
tells where every name lands and checks it with each parameter's own loader (nothing
written), then bakes where each name of a layer SGLang serves as loaded lands
(:mod:`.processing`, :mod:`weightsync.receiver.replay`); ``begin`` checks the bake still points
at the live tensors (else bakes again) and undoes in-place quantization packing; ``load``
replays each bucket's baked names as batched copies into the live parameters and hands the
rest to the model's own ``load_weights`` (its name mapping, packed qkv/gate_up slices, fused
experts, TP slicing); ``commit`` runs the model's post-load fix-ups and quantization
processing once, then loads the LoRA adapter accumulated across buckets through SGLang's
tensor adapter loading.

SGLang's ``load_weights`` skips names it does not know without a word; that is why nothing
reaches it before ``validate`` has resolved every name.

With a ``draft`` model (the speculative worker's MTP model: ``Glm4MoeForCausalLMNextN``,
``DeepseekV3ForCausalLMNextN``...), whose ``load_weights`` reads the full checkpoint names and
takes the MTP layer (``model.layers.{num_hidden_layers}.*``), one version loads into both: each
name goes to the model(s) that take it, both post-load fix-ups run, the version commits once.
Without one, MTP layer names the model does not take are ignored (a warning per version).

Tested with SGLang 0.5.23 (model classes built on CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Protocol

import torch

from weightsync.buckets import TensorSpec
from weightsync.errors import ManifestMismatchError, WeightSyncError
from weightsync.manifest import LoraAdapterSpec, VersionManifest
from weightsync.receiver.bake import bake
from weightsync.receiver.lora_accumulator import LoraAccumulator, check_adapter
from weightsync.receiver.name_resolver import (
    MtpLayers,
    ResolvedName,
    kept_boxes,
    live_tensors,
    mtp_names_left,
    refuse_unknown,
    resolve_accepted,
)
from weightsync.receiver.replay import ReplayPlan
from weightsync.receiver.sglang.processing import served_as_loaded
from weightsync.receiver.sglang.sglang_resolver import check_expert_shapes
from weightsync.receiver.target import Arrival, WeightTarget
from weightsync.topology_model import Box

logger = logging.getLogger(__name__)


class LoraLoader(Protocol):
    """Where a completed adapter goes (e.g. :class:`~.lora_loader.SglangLoraLoader`)."""

    def validate(self, spec: LoraAdapterSpec) -> None:
        """Reject an adapter the engine cannot serve, before any write."""

    def load(self, spec: LoraAdapterSpec, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load the adapter, replacing the previous adapter of the same name."""


class _ModelLoad:
    """One model a version loads into (the target model, or its draft model)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.resolved: dict[str, ResolvedName] = {}
        """The names ``load_weights`` takes (the others of this model are replayed)."""
        self.replay: ReplayPlan | None = None
        self._accepted: tuple[list[TensorSpec], dict[str, ResolvedName]] = ([], {})
        self._held: dict[str, torch.Tensor] = {}

    def accept(self, specs: list[TensorSpec], resolved: dict[str, ResolvedName]) -> None:
        """Keep what validation resolved; bake the names of layers served as loaded."""
        self._accepted = (specs, resolved)
        modules = served_as_loaded(self.model)
        live = live_tensors(self.model)
        baked = bake(self.model, specs, resolved, live, modules)
        for module, why in baked.refused.items():
            logger.info("%s takes SGLang's load_weights every version: %s", module, why)
        self.replay = ReplayPlan(baked.placements, live) if baked.placements else None
        self.resolved = {n: hit for n, hit in resolved.items() if n not in baked.placements}

    def takes(self, name: str) -> bool:
        return name in self.resolved or (self.replay is not None and name in self.replay)

    def begin(self) -> None:
        self._held = {}
        if self.replay is not None and self.replay.stale(live_tensors(self.model)) is not None:
            self.accept(*self._accepted)

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]], key: Hashable = None) -> None:
        base: list[tuple[str, torch.Tensor]] = []
        replayed: list[tuple[str, torch.Tensor]] = []
        for name, tensor in tensors:
            if self.replay is not None and name in self.replay:
                replayed.append((name, tensor))
            elif self.resolved[name].loaded_with:
                base.extend(self._with_partners(name, tensor))
            else:
                base.append((name, tensor))
        if replayed:
            self.replay.apply(replayed, key)
        if base:
            # Weight loaders copy into the live parameters, so bucket views need no copy.
            with torch.no_grad():
                self.model.load_weights(iter(base))

    def _with_partners(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Names the model loads in one call reach one ``load_weights`` together (its cache
        of the first lives only for that call); kept until the last of them arrives."""
        self._held[name] = tensor.clone()  # the bucket buffer is reused
        group = self.resolved[name].loaded_with | {name}
        if not group <= self._held.keys():
            return []
        return [(n, self._held.pop(n)) for n in sorted(group)]

    def post_load(self) -> None:
        # Derived weights (e.g. DeepSeek's absorbed MLA matrices) need every input in place.
        post_load = getattr(self.model, "post_load_weights", None)
        if callable(post_load) and (self.resolved or self.replay is not None):
            post_load()


class SglangWeightTarget(WeightTarget):
    """A :class:`~weightsync.receiver.target.WeightTarget` for an SGLang model.

    Args:
        model: the live model (``model_runner.model``).
        device: where buckets are mapped (the worker's device).
        draft: the speculative draft worker's MTP model, which takes the MTP layers of each
            version; None without one.
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
        draft: torch.nn.Module | None = None,
        lora_loader: LoraLoader | None = None,
        process_quantized: bool = True,
    ) -> None:
        self.device = torch.device(device)
        self.lora_loader = lora_loader
        self.process_quantized = process_quantized
        # What validate found, reused by every version until the core validates again (a new
        # tensor list).
        self._main = _ModelLoad(model)
        self._draft = _ModelLoad(draft) if draft is not None else None
        self._ignored: list[str] = []
        self._kept: dict[str, Box] = {}
        self._lora: LoraAccumulator | None = None
        self._restored = False

    @property
    def model(self) -> torch.nn.Module:
        return self._main.model

    @property
    def replayed(self) -> frozenset[str]:
        """The names versions replay straight into the live parameters (the rest go through
        SGLang's ``load_weights``), after :meth:`validate`."""
        replay = self._main.replay
        return frozenset(replay.placements) if replay is not None else frozenset()

    def _models(self) -> list[_ModelLoad]:
        return [self._main] if self._draft is None else [self._main, self._draft]

    # -- WeightTarget -------------------------------------------------------------------

    def validate(self, manifest: VersionManifest) -> None:
        if manifest.lora is not None:
            self._validate_lora(manifest.lora, manifest.version)
        lora_names = manifest.lora_names
        base = [spec for spec in manifest.tensors if spec.name not in lora_names]
        main, _ = resolve_accepted(self.model, base)
        draft: dict[str, ResolvedName] = {}
        mtp = MtpLayers.of(getattr(self.model, "config", None))
        if self._draft is not None:
            ours = {id(t) for t in live_tensors(self.model).values()}
            theirs = live_tensors(self._draft.model)
            # SGLang gives an MTP draft model the target's embedding and lm_head tensors
            # (set_embed_and_head): those load through the target model only.
            draft, apart = resolve_accepted(
                self._draft.model, base, elsewhere=lambda live: id(theirs[live]) in ours
            )
            # SGLang's MTP models skip the MTP layer's copy of the lm_head: they serve the
            # target's (set_embed_and_head).
            ignored = [name for name in apart if name not in main] + [
                s.name
                for s in base
                if s.name not in main
                and s.name not in draft
                and ".shared_head.head." in s.name
                and mtp is not None
                and mtp.holds(s.name)
            ]
        else:
            ignored = mtp_names_left(base, main, mtp)
        draft_model = self._draft.model if self._draft is not None else None
        refuse_unknown(base, {*main, *draft, *ignored}, self.model, draft_model)
        check_expert_shapes(self.model, [s for s in base if s.name in main], main)
        if self._draft is None:
            self._main.accept(base, main)
        else:  # the draft shares layers with this model: both take their loaders
            self._main.resolved = main
            check_expert_shapes(self._draft.model, [s for s in base if s.name in draft], draft)
            self._draft.resolved = draft
        self._ignored = ignored
        self._kept = kept_boxes(main, draft)

    def keeps(self) -> dict[str, Box]:
        return self._kept

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
        if self._ignored and self._draft is None:
            logger.warning(
                "version %d: ignoring %d MTP tensors (e.g. %r): this SGLang model has no draft "
                "model (serve with speculative decoding to use them)",
                manifest.version,
                len(self._ignored),
                self._ignored[0],
            )
        self._lora = LoraAccumulator(manifest.lora) if manifest.lora is not None else None
        for part in self._models():
            part.begin()
        if self.process_quantized:
            from sglang.srt.model_loader.loader import DefaultModelLoader

            for part in self._models():
                if part.resolved:
                    DefaultModelLoader.restore_weights_before_loading(part.model, self.device)
            self._restored = True

    def load(self, arrival: Arrival | Iterable[tuple[str, torch.Tensor]]) -> None:
        arrival = Arrival.of(arrival)
        if self._main.replay is not None:  # its pieces straight in: one copy, nothing assembled
            arrival = self._main.replay.take_pieces(arrival)
        for tensors, key in arrival.whole():
            self._load(tensors, key)

    def _load(self, tensors: Sequence[tuple[str, torch.Tensor]], key: Hashable) -> None:
        base: list[tuple[str, torch.Tensor]] = []
        for name, tensor in tensors:
            if self._lora is not None and self._lora.wants(name):
                self._lora.add(name, tensor)  # copied out: the bucket buffer is reused
            elif name in self._ignored:
                continue
            elif not any(part.takes(name) for part in self._models()):
                raise ManifestMismatchError(
                    f"{name!r} arrived in a bucket but the validated manifest does not list it"
                )
            else:
                base.append((name, tensor))
        for part in self._models():
            mine = [(name, tensor) for name, tensor in base if part.takes(name)]
            if mine:
                part.load(mine, key)

    def commit(self, manifest: VersionManifest) -> None:
        for part in self._models():
            part.post_load()
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

        for part in self._models():
            if part.resolved:
                DefaultModelLoader.postprocess_weights(part.model, self.device)


def target_from_model_runner(model_runner: Any, **kwargs: Any) -> SglangWeightTarget:
    """Build the target from an SGLang ``ModelRunner`` (inside a TP worker).

    LoRA goes through the runner's ``lora_manager`` when the server runs with ``--enable-lora``.
    """
    from weightsync.receiver.sglang.lora_loader import SglangLoraLoader

    lora_manager = getattr(model_runner, "lora_manager", None)
    kwargs.setdefault("lora_loader", SglangLoraLoader(lora_manager) if lora_manager else None)
    return SglangWeightTarget(model_runner.model, model_runner.device, **kwargs)
