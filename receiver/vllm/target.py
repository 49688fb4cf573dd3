"""``VllmWeightTarget``: load received tensors into a vLLM worker's model.

Per version: ``validate`` resolves every name against the live model and dry-runs its weight
loader (nothing written), then bakes where each name of a layer vLLM serves as loaded lands
(:mod:`.processing`, :mod:`weightsync.receiver.replay`); ``begin`` checks the bake still points
at the live tensors (else bakes again) and starts vLLM's layerwise reload for the other layers;
``load`` replays each bucket's baked names as batched copies straight into the live tensors
and hands the rest to ``model.load_weights`` (the model's own name mapping and packing);
``commit`` finalizes the reload once (post-load processing, e.g. vLLM-CPU's weight repacking)
and then registers the LoRA adapter accumulated across buckets.

With speculative decoding ``method: "mtp"`` the worker also holds a draft model (``Glm4MoeMTP``,
``DeepSeekMTP``, ``Qwen3NextMTP``...) whose ``load_weights`` reads the full checkpoint names and
takes the MTP layers (``model.layers.{num_hidden_layers + i}.*``, ``mtp.*``). One version then
loads into both models: each name goes to the model(s) whose loader takes it, both post-load
processings run, and the version commits once. Without a draft model, the names of the MTP
layers the model's config declares that the target does not take are accepted and ignored (a
warning per version): a trainer that exports MTP layers can serve without speculative decoding.
Any other name the model lacks is refused.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from weightsync.buckets import TensorSpec
from weightsync.errors import ManifestMismatchError, WeightSyncError
from weightsync.manifest import VersionManifest
from weightsync.receiver.bake import bake
from weightsync.receiver.lora_accumulator import LoraAccumulator
from weightsync.receiver.name_resolver import (
    MtpLayers,
    ResolvedName,
    aliases,
    kept_boxes,
    live_tensors,
    mtp_names_left,
    refuse_unknown,
    resolve_accepted,
)
from weightsync.receiver.replay import ReplayPlan
from weightsync.receiver.target import Arrival, WeightTarget
from weightsync.receiver.vllm.lora_store import LoraStore
from weightsync.receiver.vllm.processing import served_as_loaded
from weightsync.receiver.vllm.reload import (
    check_loaded,
    check_whole_layers,
    layerwise_module,
    loading_view,
    moe_kernel_reset,
    no_mtp_check,
)
from weightsync.topology_model import Box

logger = logging.getLogger(__name__)


def _hf_text_config(model_config: Any) -> Any:
    return getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)


class _ModelLoad:
    """One model a version loads into (the target model, or its draft model): what validate
    found, and the layerwise reload in progress."""

    def __init__(self, model: torch.nn.Module, model_config: Any) -> None:
        self.model = model
        self.model_config = model_config
        self.resolved: dict[str, ResolvedName] = {}
        self.tied: dict[str, list[str]] = {}
        self._pending_by_module: dict[str, set[str]] = {}
        self._reloading = False
        self._dropped_kernels: list[tuple[Any, Any]] = []

    def accept(
        self,
        resolved: dict[str, ResolvedName],
        view: dict[str, torch.Tensor],
    ) -> None:
        """Keep what validation resolved for this model (after the whole-layer check)."""
        if layerwise_module() is not None:
            check_whole_layers(resolved, view, self.model)
        self.resolved = resolved
        tied = aliases(self.model)
        self.tied = {
            name: same
            for name, hit in resolved.items()
            if hit.shard_id is None
            and hit.expert_id is None
            and (same := self._same_loading(hit.live_name, tied.get(hit.live_name, [])))
        }

    def _same_loading(self, live_name: str, aliases: list[str]) -> list[str]:
        """The aliases of ``live_name`` whose layer loads a checkpoint tensor as its layer does.

        A tied ``lm_head`` (``ParallelLMHead``) is a vocab embedding too: its loader takes the
        whole checkpoint tensor and keeps its own TP shard, whatever the shard's shape. An
        alias in a layer of another kind (a shared expert or a routing bias that an MoE layer
        holds too) loads a reshaped tensor and cannot take it through its own loader.
        """
        kind = type(self.model.get_submodule(live_name.rpartition(".")[0]))
        same = []
        for alias in aliases:
            other = type(self.model.get_submodule(alias.rpartition(".")[0]))
            if issubclass(other, kind) or issubclass(kind, other):
                same.append(alias)
        return same

    def begin(self) -> None:
        by_module: dict[str, set[str]] = defaultdict(set)
        for name, hit in self.resolved.items():
            by_module[hit.module_name].add(name)
        self._pending_by_module = dict(by_module)
        layerwise = layerwise_module()
        if layerwise is not None and self.resolved:
            self._dropped_kernels = moe_kernel_reset(self.model, set(by_module))
            layerwise.initialize_layerwise_reload(self.model)
            self._reloading = True

    def load(self, base: Sequence[tuple[str, torch.Tensor]]) -> None:
        here = {name for name, _ in base}
        batch = []
        for name, tensor in base:
            pending = self._pending_by_module[self.resolved[name].module_name]
            # Layerwise reload keeps a reference until the whole layer has arrived; the
            # bucket buffer is reused, so a layer finishing in a later bucket needs a copy.
            batch.append((name, tensor if pending <= here else tensor.clone()))
        for name, _ in base:
            self._pending_by_module[self.resolved[name].module_name].discard(name)
        with torch.no_grad(), no_mtp_check():
            loaded = self.model.load_weights(iter(batch))
        check_loaded(base, self.resolved, loaded)
        self._load_tied_aliases(batch)

    def _load_tied_aliases(self, batch: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Reload the other layers sharing a tied weight (``lm_head`` for the embedding).

        The model's loader fills the weight once, through its first layer; layerwise reload
        then rebuilds only that layer and restores the alias layer's old post-processed
        tensors (vLLM-CPU's repacked lm_head keeps serving the OLD embedding). Loading the
        alias through its own weight loader makes vLLM process that layer too.
        """
        for name, tensor in batch:
            for alias in self.tied.get(name, ()):
                param = self.model.get_parameter(alias)
                loader = getattr(param, "weight_loader", None)
                if loader is not None:
                    with torch.no_grad():
                        loader(param, tensor)

    def finish(self) -> None:
        self._finish_reload()
        self._dropped_kernels = []

    def abort(self) -> None:
        # Put every untouched layer's weights back so the engine keeps serving.
        self._finish_reload()
        for quant_method, kernel in self._dropped_kernels:
            if quant_method.moe_kernel is None:  # a layer the failed version never reached
                quant_method.moe_kernel = kernel
        self._dropped_kernels = []

    def _finish_reload(self) -> None:
        if not self._reloading:
            return
        self._reloading = False
        layerwise = layerwise_module()
        if layerwise is not None:
            layerwise.finalize_layerwise_reload(self.model, self.model_config)


class VllmWeightTarget(WeightTarget):
    """A :class:`~weightsync.receiver.target.WeightTarget` for one vLLM worker's model.

    Args:
        model: the worker's model (``worker.model_runner.get_model()``).
        model_config: the worker's ``ModelConfig`` (post-load processing needs its dtype).
        device: the worker's device; buckets are mapped there.
        draft: the speculative draft model and its ``ModelConfig`` (``method: "mtp"``), which
            takes the MTP layers of each version; None without one.
        lora_store: where adapters are written and registered; None when LoRA is off.
        after_reload: called once after post-load processing and before the adapter is
            registered (the worker's ``reset_lora_state``: vLLM invalidates adapters when
            base weights change).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: Any,
        device: torch.device,
        *,
        draft: tuple[torch.nn.Module, Any] | None = None,
        lora_store: LoraStore | None = None,
        after_reload: Callable[[], None] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.lora_store = lora_store
        self.after_reload = after_reload
        # What validate found, reused by every version until the core validates again (a new
        # tensor list, or a new generation after retarget).
        self._main = _ModelLoad(model, model_config)
        self._draft = _ModelLoad(*draft) if draft is not None else None
        self._ignored: list[str] = []
        self._kept: dict[str, Box] = {}
        self._lora: LoraAccumulator | None = None
        self._replay: ReplayPlan | None = None
        self._accepted: tuple[list[TensorSpec], dict[str, ResolvedName], dict] | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self._main.model

    @property
    def model_config(self) -> Any:
        return self._main.model_config

    @property
    def draft_model(self) -> torch.nn.Module | None:
        return self._draft.model if self._draft is not None else None

    @property
    def draft_config(self) -> Any:
        return self._draft.model_config if self._draft is not None else None

    @property
    def replayed(self) -> frozenset[str]:
        """The names versions replay straight into the live tensors (the rest go through
        vLLM's loaders): those of layers served as loaded, after :meth:`validate`."""
        return frozenset(self._replay.placements) if self._replay is not None else frozenset()

    @classmethod
    def from_worker(cls, worker: Any, lora_dir: str | None = None) -> VllmWeightTarget:
        """Build the target from a vLLM worker (inside ``collective_rpc``)."""
        runner = worker.model_runner
        lora_manager = getattr(runner, "lora_manager", None)
        store = LoraStore(lora_dir, lora_manager) if getattr(runner, "lora_config", None) else None
        return cls(
            runner.get_model(),
            worker.vllm_config.model_config,
            worker.device,
            draft=draft_of(runner, worker.vllm_config),
            lora_store=store,
            after_reload=getattr(runner, "reset_lora_state", None),
        )

    def retarget(
        self,
        model: torch.nn.Module,
        model_config: Any,
        draft: tuple[torch.nn.Module, Any] | None = None,
    ) -> None:
        """Load the next versions into ``model`` and ``draft`` (vLLM's draft model alone for
        a draft session)."""
        if model is self.model and (draft[0] if draft else None) is self.draft_model:
            return
        self.generation += 1  # the core validates the next manifest against these models
        self._main = _ModelLoad(model, model_config)
        self._draft = _ModelLoad(*draft) if draft is not None else None

    # -- WeightTarget -------------------------------------------------------------------

    def validate(self, manifest: VersionManifest) -> None:
        lora_names = manifest.lora_names
        if manifest.lora is not None:
            if self.lora_store is None:
                raise ManifestMismatchError(
                    f"version {manifest.version} carries LoRA adapter {manifest.lora.name!r} "
                    "but this vLLM engine runs without LoRA; start it with enable_lora=True"
                )
            self.lora_store.validate(manifest.lora)
        base = [spec for spec in manifest.tensors if spec.name not in lora_names]
        view = loading_view(self.model)
        with no_mtp_check():
            main, _ = resolve_accepted(self.model, base, view)
        draft: dict[str, ResolvedName] = {}
        ignored: list[str] = []
        if self._draft is not None:
            draft_model = self._draft.model
            ours = {id(module) for module in self.model.modules()}

            def shared(live_name: str) -> bool:
                return id(draft_model.get_submodule(live_name.rpartition(".")[0])) in ours

            # vLLM shares the target's embedding and lm_head modules with an MTP draft model:
            # those load through the target model only, and the draft's own copy of them
            # (``shared_head.head``) is what the engine drops after loading too.
            draft_view = loading_view(draft_model)
            with no_mtp_check():
                draft, apart = resolve_accepted(draft_model, base, draft_view, elsewhere=shared)
            ignored = [name for name in apart if name not in main]
        else:
            ignored = mtp_names_left(base, main, MtpLayers.of(_hf_text_config(self.model_config)))
        draft_model = self._draft.model if self._draft is not None else None
        refuse_unknown(base, {*main, *draft, *ignored}, self.model, draft_model)
        self._accepted = (base, main, view)
        self._split_replay()
        if self._draft is not None:
            self._draft.accept(draft, draft_view)
        self._ignored = ignored
        self._kept = kept_boxes(main, draft)

    def _split_replay(self) -> None:
        """Bake the accepted names of layers served as loaded (not with a draft model, which
        shares layers with this one); the others take the engine's path."""
        assert self._accepted is not None
        base, main, view = self._accepted
        self._replay = None
        if self._draft is None:
            modules = served_as_loaded(self.model)
            with no_mtp_check():
                baked = bake(self.model, base, main, view, modules)
            for module, why in baked.refused.items():
                logger.info("%s takes vLLM's loader every version: %s", module, why)
            if baked.placements:
                self._replay = ReplayPlan(baked.placements, live_tensors(self.model))
        replayed = self._replay.placements if self._replay is not None else {}
        self._main.accept({n: hit for n, hit in main.items() if n not in replayed}, view)

    def keeps(self) -> dict[str, Box]:
        return self._kept

    def begin(self, manifest: VersionManifest) -> None:
        if self._ignored and self._draft is None:
            logger.warning(
                "version %d: ignoring %d MTP tensors (e.g. %r): this vLLM engine has no draft "
                "model (start it with speculative_config method 'mtp' to serve them)",
                manifest.version,
                len(self._ignored),
                self._ignored[0],
            )
        self._lora = LoraAccumulator(manifest.lora) if manifest.lora is not None else None
        if self._replay is not None:
            moved = self._replay.stale(live_tensors(self.model))
            if moved is not None:
                logger.info(
                    "version %d: %r moved since the bake: baking again", manifest.version, moved
                )
                self._split_replay()
        self._main.begin()
        if self._draft is not None:
            self._draft.begin()

    def load(self, arrival: Arrival | Iterable[tuple[str, torch.Tensor]]) -> None:
        arrival = Arrival.of(arrival)
        if self._replay is not None:  # its pieces straight in: one copy, nothing assembled
            arrival = self._replay.take_pieces(arrival)
        for tensors, key in arrival.whole():
            base: list[tuple[str, torch.Tensor]] = []
            for name, tensor in tensors:
                if self._lora is not None and self._lora.wants(name):
                    self._lora.add(name, tensor)
                else:
                    base.append((name, tensor))
            if self._replay is not None:
                replayed = [(n, t) for n, t in base if n in self._replay]
                if replayed:
                    self._replay.apply(replayed, key)
            for part in (self._main, self._draft):
                mine = [(n, t) for n, t in base if part is not None and n in part.resolved]
                if part is not None and mine:
                    part.load(mine)

    def commit(self, manifest: VersionManifest) -> None:
        self._main.finish()
        if self._draft is not None:
            self._draft.finish()
        if self.after_reload is not None:
            self.after_reload()
        if self._lora is not None and self.lora_store is not None:
            self.lora_store.register(self._lora.complete(), manifest.version)
        self._lora = None

    def abort(self, manifest: VersionManifest, error: WeightSyncError) -> None:
        self._main.abort()
        if self._draft is not None:
            self._draft.abort()
        self._lora = None


def draft_of(runner: Any, vllm_config: Any) -> tuple[torch.nn.Module, Any] | None:
    """The model runner's MTP draft model and its ``ModelConfig``; None without one.

    Only an MTP draft reads the target's checkpoint names. An EAGLE head or a separate draft
    model has a checkpoint of its own, with names that clash with the target's
    (``model.layers.0.*``): vLLM updates those in a draft session of their own.
    """
    speculative = getattr(vllm_config, "speculative_config", None)
    get_draft_model = getattr(runner, "get_draft_model", None)
    if getattr(speculative, "method", None) != "mtp" or not callable(get_draft_model):
        return None
    draft = get_draft_model()
    return (draft, speculative.draft_model_config) if draft is not None else None
