"""Resolve checkpoint (HF) tensor names against a LIVE engine model, without per-model tables.

Every rule probes what the model itself exposes:

- ``named_parameters(remove_duplicate=False)`` and ``named_buffers()`` (or a caller-supplied
  view of them, e.g. vLLM's pre-processing "loading format" tensors);
- the model's HF-to-engine name mapper (``hf_to_vllm_mapper``: a ``WeightsMapper``), whose
  stacked entries also give the shard id (``.q_proj`` -> ``(.qkv_proj, "q")``);
- ``packed_modules_mapping`` (``qkv_proj <- q/k/v``, ``gate_up_proj <- gate/up``) where the
  mapper has no stacked entries (older vLLM, SGLang);
- ``get_expert_mapping()`` of every module that has one (fused MoE experts), or of the model;
- ``.base_layer`` inserted or removed as the live model needs (LoRA-wrapped layers).

Resolution only names things; :func:`check_specs` then dry-runs each parameter's own
``weight_loader`` on meta tensors, so shapes are checked by the engine's own loading logic
(vocab padding, tensor parallel slicing, packed offsets) before any byte is written.
"""

from __future__ import annotations

import gc
import inspect
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from weightsync.buckets import TensorSpec
from weightsync.errors import ManifestMismatchError, NameResolutionError
from weightsync.receiver.reads import LoaderReads, bounding
from weightsync.topology_model import Box

ShardId = str | int

_QKV_SHARD_IDS = ("q", "k", "v")
_BASE_LAYER = "base_layer"


@dataclass(frozen=True)
class ResolvedName:
    """Where one checkpoint tensor goes in the live model."""

    name: str
    """The checkpoint (manifest) name."""
    live_name: str
    """The live parameter or buffer it loads into."""
    shard_id: ShardId | None = None
    """Which slice of a packed parameter (``"q"``, ``0``, ``"w1"``...), or None for all of it."""
    expert_id: int | None = None
    """The expert index inside a fused expert parameter."""
    expert_weight_name: str | None = None
    """The checkpoint fragment the expert mapping matched (the expert loader wants it)."""
    loaded_with: frozenset[str] = frozenset()
    """Other checkpoint names the model loads in the same call (SGLang's DeepSeek concatenates
    ``q_a_proj`` and ``kv_a_proj_with_mqa``): they must reach ``load_weights`` together."""
    box: Box | None = None
    """The part of the checkpoint tensor this rank's loaders read (a TP shard), or None for
    all of it; learned by :func:`resolve_by_loading` (:mod:`.reads`)."""

    @property
    def module_name(self) -> str:
        return self.live_name.rpartition(".")[0]


def live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every live parameter and buffer by name, tied aliases included (``lm_head.weight``)."""
    tensors: dict[str, torch.Tensor] = dict(model.named_buffers())
    tensors.update(model.named_parameters(remove_duplicate=False))
    return tensors


def _base_layer_variants(name: str) -> list[str]:
    """``a.b.weight`` <-> ``a.b.base_layer.weight``."""
    parts = name.split(".")
    if _BASE_LAYER in parts:
        return [".".join(p for p in parts if p != _BASE_LAYER)]
    if len(parts) < 2:
        return []
    return [".".join([*parts[:-1], _BASE_LAYER, parts[-1]])]


def _map_with_shard(mapper: object, name: str) -> tuple[str, ShardId | None] | None:
    """Apply the model's HF-to-engine mapper; None when the mapper drops the name."""
    with_shard = getattr(mapper, "_map_name_with_shard", None)
    if callable(with_shard):  # vLLM >= 0.31: stacked entries carry the shard id
        result = with_shard(name)
        if result is None:
            return None
        mapped, shard = result
        if isinstance(shard, list):
            # One tensor loaded into several shards; the dry run checks the first.
            shard = shard[0] if shard else None
        return mapped, shard
    map_name = getattr(mapper, "map_name", None) or getattr(mapper, "_map_name", None)
    if callable(map_name):
        mapped = map_name(name)
        return None if mapped is None else (mapped, None)
    return name, None


ExpertMapping = list[tuple[str, str, int, str]]
"""``(param_name, checkpoint_fragment, expert_id, shard_id)`` per fused-expert slot."""


def vllm_expert_mapping(module: torch.nn.Module) -> ExpertMapping:
    """A module's own ``get_expert_mapping()``; empty when it has none."""
    get_mapping = getattr(module, "get_expert_mapping", None)
    if not callable(get_mapping):
        return []
    try:
        return list(get_mapping())
    except (TypeError, AttributeError, NotImplementedError):
        # Models whose get_expert_mapping needs arguments or is not MoE at all.
        return []


class NameResolver:
    """Maps checkpoint names onto a live model's tensors by probing the model.

    Args:
        model: the live engine model (vLLM / SGLang ``nn.Module``).
        tensors: the live tensors to resolve against, by name. Defaults to
            :func:`live_tensors`; vLLM passes its loading-format view instead, because
            vLLM-CPU repacks weights after loading and the live parameters lose their shape.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        packed_modules: Mapping[str, list[str]] | None = None,
        expert_mapping: Callable[[torch.nn.Module], ExpertMapping] | None = None,
    ) -> None:
        """
        Args:
            model: the live engine model.
            tensors: its tensors by live name (default: parameters and buffers).
            packed_modules: ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``; default the
                model's ``packed_modules_mapping`` (vLLM's spelling).
            expert_mapping: a module's ``(param, checkpoint fragment, expert id, shard id)``
                list, empty for modules without fused experts; default the module's
                ``get_expert_mapping()`` (vLLM's spelling).
        """
        self.model = model
        self.tensors: Mapping[str, torch.Tensor] = (
            tensors if tensors is not None else live_tensors(model)
        )
        # Tied weights are one live object under two names; a caller's view may hold
        # separate copies, so identity comes from the live model.
        self._identity = {name: id(t) for name, t in live_tensors(model).items()}
        self._canonical = {id(t): name for name, t in model.named_parameters()}
        self._mapper = getattr(model, "hf_to_vllm_mapper", None)
        if packed_modules is None:
            packed_modules = getattr(model, "packed_modules_mapping", {})
        self._packed: dict[str, list[str]] = {k: list(v) for k, v in packed_modules.items()}
        self._modules = dict(model.named_modules())
        mapping_of = expert_mapping or vllm_expert_mapping
        found = [(path, m) for path, module in self._modules.items() if (m := mapping_of(module))]
        # Submodules first: the most specific module owning a fused parameter wins.
        found.sort(key=lambda item: -len(item[0]))
        self._expert_modules = found

    def identity(self, live_name: str) -> int:
        """Equal for two names of one live tensor (tied weights)."""
        return self._identity.get(live_name, id(self.tensors[live_name]))

    def aliases(self, live_name: str) -> list[str]:
        """Other live names of the same tensor (a tied ``lm_head.weight`` for the embedding)."""
        ident = self.identity(live_name)
        return [n for n, i in self._identity.items() if i == ident and n != live_name]

    def tied_to(self, live_name: str) -> str | None:
        """The name the model loads a tied alias through (``lm_head`` -> the embedding)."""
        canonical = self._canonical.get(self.identity(live_name))
        return canonical if canonical not in (None, live_name) else None

    def _existing(self, candidate: str) -> str | None:
        if candidate in self.tensors:
            return candidate
        for variant in _base_layer_variants(candidate):
            if variant in self.tensors:
                return variant
        return None

    def _qkv_like(self, live_name: str) -> bool:
        module = self._modules.get(live_name.rpartition(".")[0])
        return module is not None and "QKV" in type(module).__name__

    def _resolve_packed(self, name: str) -> ResolvedName | None:
        parts = name.split(".")
        for packed, members in self._packed.items():
            for index, member in enumerate(members):
                for i, part in enumerate(parts):
                    if part != member:
                        continue
                    candidate = ".".join([*parts[:i], packed, *parts[i + 1 :]])
                    live = self._existing(candidate)
                    if live is None:
                        continue
                    qkv = len(members) == len(_QKV_SHARD_IDS) and self._qkv_like(live)
                    shard: ShardId = _QKV_SHARD_IDS[index] if qkv else index
                    return ResolvedName(name, live, shard)
        return None

    def _resolve_expert(self, name: str) -> ResolvedName | None:
        for path, mapping in self._expert_modules:
            for param_name, weight_name, expert_id, shard_id in mapping:
                head, found, tail = name.partition(weight_name)
                if not found or not path.startswith(head.rstrip(".")):
                    continue
                # The classic loader rule first, then the parameter as an attribute of the
                # module owning the mapping (vLLM 0.32 nests it in ``routed_experts``).
                candidates = [head + param_name + tail]
                attribute = (param_name + tail).rpartition(".")[2]
                candidates.append(f"{path}.{attribute}" if path else attribute)
                for candidate in candidates:
                    live = self._existing(candidate)
                    if live is not None:
                        return ResolvedName(name, live, shard_id, expert_id, weight_name)
        return None

    def resolve(self, name: str) -> ResolvedName | None:
        """Where ``name`` loads in the live model, or None when the model has no such tensor."""
        mapped = _map_with_shard(self._mapper, name)
        if mapped is None:
            return None
        mapped_name, shard = mapped
        live = self._existing(mapped_name)
        if live is not None:
            return ResolvedName(name, live, shard)
        for target in (mapped_name, name):
            resolved = self._resolve_expert(target) or self._resolve_packed(target)
            if resolved is not None:
                return ResolvedName(name, *_fields_after_name(resolved))
        return None

    def resolve_all(self, names: Iterable[str]) -> dict[str, ResolvedName]:
        """Resolve every name; raise naming ALL the names the model lacks.

        Raises:
            NameResolutionError: one or more names have no live tensor.
        """
        resolved: dict[str, ResolvedName] = {}
        missing: list[str] = []
        for name in names:
            hit = self.resolve(name)
            if hit is None:
                missing.append(name)
            else:
                resolved[name] = hit
        if missing:
            shown = ", ".join(repr(n) for n in missing[:8])
            more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
            raise NameResolutionError(
                f"the live {type(self.model).__name__} has no tensor for {shown}{more}. Check "
                "the sender's name templates for this architecture, or drop these tensors "
                "from the version."
            )
        return resolved


def _fields_after_name(r: ResolvedName) -> tuple[str, ShardId | None, int | None, str | None]:
    return r.live_name, r.shard_id, r.expert_id, r.expert_weight_name


def meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """A meta copy that keeps the tensor's class and attributes (``weight_loader``...)."""
    meta = tensor.data.to("meta")
    meta.__class__ = tensor.__class__
    meta.__dict__ = tensor.__dict__.copy()
    return meta


def _default_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} != {tuple(param.shape)}")


def _dry_run(resolved: ResolvedName, live: torch.Tensor, spec: TensorSpec) -> None:
    """Run the parameter's own weight loader on meta tensors: shapes checked, nothing written."""
    loader: Callable = getattr(live, "weight_loader", None) or _default_loader
    # Unwrap vLLM's layerwise-reload wrappers: the dry run must not count as a load.
    while getattr(loader, "__name__", "") == "online_process_loader" and hasattr(
        loader, "__wrapped__"
    ):
        loader = loader.__wrapped__
    param = meta_like(live)
    loaded = torch.empty(spec.shape, dtype=spec.torch_dtype, device="meta")
    if resolved.expert_id is not None:
        loader(
            param=param,
            loaded_weight=loaded,
            weight_name=resolved.expert_weight_name,
            shard_id=resolved.shard_id,
            expert_id=resolved.expert_id,
            **_return_success_kwarg(loader),
        )
    elif resolved.shard_id is not None:
        loader(param, loaded, resolved.shard_id)
    else:
        loader(param, loaded)


def _return_success_kwarg(loader: Callable) -> dict[str, bool]:
    try:
        params = inspect.signature(loader).parameters
    except (TypeError, ValueError):
        return {}
    return {"return_success": True} if "return_success" in params else {}


def check_specs(resolver: NameResolver, specs: Sequence[TensorSpec]) -> dict[str, ResolvedName]:
    """Resolve ``specs`` and check dtype and shape against the live model, writing nothing.

    Raises:
        NameResolutionError: names the model lacks (all of them, in one message).
        ManifestMismatchError: the first tensor whose dtype or shape the model rejects, or
            two names loading into the same live slice (e.g. a tied ``lm_head``).
    """
    resolved = resolver.resolve_all(spec.name for spec in specs)
    seen: dict[tuple[int, ShardId | None, int | None], str] = {}
    for spec in specs:
        hit = resolved[spec.name]
        live = resolver.tensors[hit.live_name]
        key = (resolver.identity(hit.live_name), hit.shard_id, hit.expert_id)
        if key in seen:
            raise ManifestMismatchError(
                f"{spec.name!r} and {seen[key]!r} both load into live {hit.live_name!r} "
                "(tied or duplicated weights); send only one of them."
            )
        seen[key] = spec.name
        canonical = resolver.tied_to(hit.live_name)
        if canonical is not None:
            raise NameResolutionError(
                f"{spec.name!r} is tied to {canonical!r} in the live model, which loads it "
                "only through that name; send the embedding's tensor instead"
            )
        if spec.torch_dtype != live.dtype:
            raise ManifestMismatchError(
                f"{spec.name!r} is {spec.dtype} but live {hit.live_name!r} is {live.dtype}; "
                "publish it in the engine's dtype."
            )
        try:
            _dry_run(hit, live, spec)
        except (AssertionError, RuntimeError, ValueError, IndexError, TypeError) as e:
            raise ManifestMismatchError(
                f"{spec.name!r} with shape {list(spec.shape)} does not fit live "
                f"{hit.live_name!r} (shape {list(live.shape)}, shard {hit.shard_id!r}): "
                f"{e or type(e).__name__}. Check the model config the sender planned with."
            ) from e
    return resolved


# --- Resolution by a dry run of the model's own ``load_weights`` -------------------------------

_SHARD_ARGS = ("shard_id", "loaded_shard_id")
# What engine code raises for a tensor it cannot take (shape asserts, narrow, copy, lookups).
_LOADER_ERRORS = (
    AssertionError,
    RuntimeError,
    ValueError,
    IndexError,
    TypeError,
    KeyError,
    NotImplementedError,
)
_LISTED = 8


def _engine_default_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """The engines' ``default_weight_loader`` on meta: a whole copy (or a scalar fill)."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        return
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape {tuple(loaded_weight.shape)} != {tuple(param.shape)}")


def _unwrapped(loader: Callable) -> Callable:
    """vLLM's layerwise-reload wrapper off: a dry run must not count as a load."""
    while getattr(loader, "__name__", "") == "online_process_loader" and hasattr(
        loader, "__wrapped__"
    ):
        loader = loader.__wrapped__
    return loader


def _positional_names(loader: Callable) -> tuple[str, ...]:
    """The names of the loader's arguments after ``(param, loaded_weight)``."""
    try:
        params = list(inspect.signature(loader).parameters.values())
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)[2:]


class _Param:
    """One live parameter during the dry run: its loader swapped for a recorder, and the
    real loader with a meta stand-in to check against."""

    def __init__(self, name: str, param: torch.Tensor, loading: torch.Tensor) -> None:
        self.name = name
        self.param = param
        # SGLang's and vLLM's parameter classes expose the loader as a read-only property.
        self._via_property = isinstance(getattr(type(param), "weight_loader", None), property)
        self._had_own = "weight_loader" in param.__dict__
        self._original = getattr(param, "weight_loader", None)
        self.loader = _unwrapped(getattr(loading, "weight_loader", None) or _engine_default_loader)
        self.meta = meta_like(loading)
        self._positional = _positional_names(self.loader)

    def install(self, recorder: Callable) -> None:
        if self._via_property:
            self.param._weight_loader = recorder
        else:
            self.param.weight_loader = recorder
        if self.param.weight_loader is not recorder:
            raise RuntimeError(f"cannot intercept the weight loader of {self.name!r}")

    def restore(self) -> None:
        if self._via_property:
            self.param._weight_loader = self._original
        elif self._had_own:
            self.param.weight_loader = self._original
        else:
            del self.param.weight_loader

    def arguments(self, args: tuple, kwargs: dict) -> dict[str, object]:
        """The loader's arguments by name (models pass shard and expert ids either way)."""
        return {**dict(zip(self._positional, args, strict=False)), **kwargs}


class _Traced(torch.Tensor):
    """A meta input that remembers the checkpoint names it was computed from, through any
    torch op: a model may transpose, cast or concatenate inputs before loading them (SGLang's
    DeepSeek fuses ``q_a_proj`` and ``kv_a_proj_with_mqa`` into one parameter)."""

    sources: frozenset[str] = frozenset()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        sources = frozenset().union(
            *(leaf.sources for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, _Traced))
        )
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if _reads is not None:
            _reads.after(getattr(func, "__name__", ""), (args, kwargs), out)
        return tree_map_only(torch.Tensor, lambda t: _traced(t, sources), out)


_reads: LoaderReads | None = None
"""The running dry run's reads (one dry run at a time: the model's loaders are swapped)."""


def _traced(tensor: torch.Tensor, sources: frozenset[str]) -> _Traced:
    traced = tensor.as_subclass(_Traced)
    traced.sources = sources
    return traced


class _DryRun:
    """Records where each checkpoint name lands; see :func:`resolve_by_loading`."""

    def __init__(
        self,
        model: torch.nn.Module,
        specs: Sequence[TensorSpec],
        loading: Mapping[str, torch.Tensor] | None,
    ) -> None:
        self.model = model
        self.specs = list(specs)
        self.inputs = [
            _traced(torch.empty(s.shape, dtype=s.torch_dtype, device="meta"), frozenset([s.name]))
            for s in specs
        ]
        self.calls = 0
        self.call_of: dict[tuple[str, int], int] = {}  # (name, hit index) -> loader call
        self.current: str | None = None
        self.position = 0
        self.hits: dict[str, list[ResolvedName]] = {}
        self.misfits: dict[str, str] = {}  # the real loader refused the tensor
        self.refused: dict[str, str] = {}  # the model's own code refused the name
        self.params = [_Param(n, p, (loading or {}).get(n, p)) for n, p in model.named_parameters()]
        # Experts of one fused parameter differ only in their index: one real loader run per
        # (parameter, shard, shape, dtype) checks them all (18k names in a 48x128 MoE), and
        # what it read of its input stands for what the others' would.
        self.checked: dict[tuple[object, ...], tuple[str | None, object, Box | None]] = {}
        self.reads = LoaderReads((s.name, t) for s, t in zip(self.specs, self.inputs, strict=True))

    def _recorder(self, entry: _Param) -> Callable:
        def record(param: torch.Tensor, loaded_weight: torch.Tensor, *args, **kwargs) -> object:
            # What the tensor was computed from, not what is being fed: a model may read ahead,
            # cache one input until another arrives, or load from worker threads.
            names = getattr(loaded_weight, "sources", None) or (
                [self.current] if self.current is not None else []
            )
            self.calls += 1
            bound = entry.arguments(args, kwargs)
            shard = next((bound[k] for k in _SHARD_ARGS if bound.get(k) is not None), None)
            expert = bound.get("expert_id")
            with torch._C.DisableTorchFunctionSubclass():  # no tracing: 18k names
                key = (entry.name, shard, loaded_weight.shape, loaded_weight.dtype)
            if expert is None or key not in self.checked:
                self.checked[key] = self._check(entry, loaded_weight, args, kwargs)
            else:
                self._reuse_read(loaded_weight, self.checked[key][2])
            error, result, _ = self.checked[key]
            for name in names:
                self.hits.setdefault(name, []).append(
                    ResolvedName(name, entry.name, shard, expert, bound.get("weight_name"))
                )
                self.call_of[(name, len(self.hits[name]) - 1)] = self.calls
                if error is not None:
                    self.misfits.setdefault(
                        name,
                        f"does not fit live {entry.name!r} (shape {list(entry.meta.shape)}, "
                        f"shard {shard!r}): {error}",
                    )
            return result  # vLLM's expert loaders answer whether the expert was theirs

        return record

    def _check(
        self, entry: _Param, loaded: torch.Tensor, args: tuple, kwargs: dict
    ) -> tuple[str | None, object, Box | None]:
        """The real loader on the meta parameter: why it refused (or None), what it returned
        and what it read of ``loaded`` when that is a whole input."""
        name = self.reads.input_name(loaded)
        with self.reads.capturing() as got:
            try:
                result: tuple[str | None, object] = (
                    None,
                    entry.loader(entry.meta, loaded, *args, **kwargs),
                )
            except _LOADER_ERRORS as e:
                result = (str(e) or type(e).__name__, False)
        return (*result, bounding(box for n, box in got if n == name) if name else None)

    def _reuse_read(self, loaded: torch.Tensor, box: Box | None) -> None:
        name = self.reads.input_name(loaded)
        if name is not None and box is not None:
            self.reads.add(name, box)

    def _feed(self, start: int) -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(start, len(self.specs)):
            self.current, self.position = self.specs[i].name, i
            yield self.specs[i].name, self.inputs[i]
        self.current = None

    def run(self) -> None:
        global _reads
        for entry in self.params:
            entry.install(self._recorder(entry))
        _reads = self.reads
        try:
            start = 0
            while start < len(self.specs):
                self.position = start
                try:
                    with torch.no_grad():
                        self.model.load_weights(self._feed(start))
                    break
                except _LOADER_ERRORS as e:
                    # The model's own code (a ``params_dict[name]`` lookup, a "no module
                    # named" check) refused this name: note it, go on with the rest.
                    name = self.specs[self.position].name
                    self.refused.setdefault(name, f"{type(e).__name__}: {e}")
                    start = self.position + 1
        finally:
            _reads = None
            self.current = None
            for entry in self.params:
                entry.restore()


def resolve_by_loading(
    model: torch.nn.Module,
    specs: Sequence[TensorSpec],
    loading: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, ResolvedName]:
    """Where each spec's tensor lands in ``model``, learned from its own ``load_weights``.

    Every live parameter's ``weight_loader`` is swapped for a recorder and ``load_weights``
    runs once over META tensors of the specs' names, shapes and dtypes: each loader call the
    model makes says which checkpoint name lands in which live parameter, with which shard
    and expert arguments; the parameter's REAL loader then runs with the same arguments on a
    meta copy, so the engine's own slicing (TP, packed offsets, experts, a transposed Conv1D)
    checks the shape. Nothing is written: the inputs are meta tensors, real loaders see meta
    parameters only, and code that bypasses ``weight_loader`` cannot copy out of a meta tensor.
    A name the model takes nowhere (unknown, or a tied ``lm_head``) is unresolved. Cost: one
    pass of the model's own loader, linear in names.

    Args:
        model: the live engine model (vLLM / SGLang), with ``load_weights``.
        specs: the checkpoint tensors to resolve.
        loading: per live name, the tensor in loading format to check against (vLLM's
            recorded metadata, when post-processing repacked the live weights); default the
            live parameters.

    Raises:
        NameResolutionError: names the model loads nowhere (all of them, in one message).
        ManifestMismatchError: the first tensor whose dtype or shape the live model rejects,
            or two names loading into the same live slice.
    """
    run = _dry_run_of(model, specs, loading)
    unresolved = [s.name for s in run.specs if s.name not in run.hits]
    if unresolved:
        shown = ", ".join(
            repr(n) + (f" ({run.refused[n]})" if n in run.refused else "")
            for n in unresolved[:_LISTED]
        )
        more = f" (and {len(unresolved) - _LISTED} more)" if len(unresolved) > _LISTED else ""
        raise NameResolutionError(
            f"the live {type(model).__name__} has no tensor for {shown}{more}: its "
            "load_weights loads them nowhere (unknown names, or a tied lm_head that loads "
            "through the embedding). Check the sender's name templates for this "
            "architecture, or drop these tensors from the version."
        )
    return _checked(run)


def resolve_accepted(
    model: torch.nn.Module,
    specs: Sequence[TensorSpec],
    loading: Mapping[str, torch.Tensor] | None = None,
    *,
    elsewhere: Callable[[str], bool] | None = None,
) -> tuple[dict[str, ResolvedName], list[str]]:
    """:func:`resolve_by_loading` for the names ``model`` takes; the others are left out.

    For a version split over several models (a target model and its MTP draft model, each
    taking its own layers): the caller decides what to do with names no model takes.

    Args:
        elsewhere: true for a live name that belongs to another model, which loads it itself
            (vLLM's MTP draft model shares the target's embedding and lm_head modules).

    Returns:
        Where each taken name lands, checked; and, apart and unchecked, the names that land
        only in live tensors ``elsewhere``.

    Raises:
        ManifestMismatchError: as :func:`resolve_by_loading`, for the names the model takes.
    """
    run = _dry_run_of(model, specs, loading)
    apart = [
        name
        for name, hits in run.hits.items()
        if elsewhere is not None and all(elsewhere(hit.live_name) for hit in hits)
    ]
    for name in apart:
        del run.hits[name]
        run.misfits.pop(name, None)
    run.call_of = {key: call for key, call in run.call_of.items() if key[0] in run.hits}
    return _checked(run), apart


def _dry_run_of(
    model: torch.nn.Module,
    specs: Sequence[TensorSpec],
    loading: Mapping[str, torch.Tensor] | None,
) -> _DryRun:
    # Tens of thousands of short-lived objects (one meta tensor per name): without the cyclic
    # collector's passes over them the dry run takes a third less time.
    collecting = gc.isenabled()
    gc.disable()
    try:
        run = _DryRun(model, specs, loading)
        run.run()
    finally:
        if collecting:
            gc.enable()
    return run


def _checked(run: _DryRun) -> dict[str, ResolvedName]:
    """The dry run's landing places of the names it resolved, after checking their dtype,
    their fit (the real loaders' verdict) and that no two names load into one live slice."""
    dtypes = {entry.name: entry.meta.dtype for entry in run.params}
    seen: dict[tuple[str, ShardId | None, int | None], tuple[str, int]] = {}
    for spec in run.specs:
        if spec.name not in run.hits:
            continue
        if spec.name in run.misfits:
            raise ManifestMismatchError(
                f"{spec.name!r} with shape {list(spec.shape)} {run.misfits[spec.name]}. Check "
                "the model config the sender planned with."
            )
        for index, hit in enumerate(run.hits[spec.name]):
            if spec.torch_dtype != dtypes[hit.live_name]:
                raise ManifestMismatchError(
                    f"{spec.name!r} is {spec.dtype} but live {hit.live_name!r} is "
                    f"{dtypes[hit.live_name]}; publish it in the engine's dtype."
                )
            # Inputs the model concatenated into one call share it; two calls may not.
            key = (hit.live_name, hit.shard_id, hit.expert_id)
            call = run.call_of[(spec.name, index)]
            first, first_call = seen.setdefault(key, (spec.name, call))
            if first != spec.name and first_call != call:
                raise ManifestMismatchError(
                    f"{spec.name!r} and {first!r} both load into live {hit.live_name!r} "
                    f"(shard {hit.shard_id!r}); send only one of them."
                )
    by_call: dict[int, set[str]] = {}
    for (name, _), call in run.call_of.items():
        by_call.setdefault(call, set()).add(name)
    partners: dict[str, frozenset[str]] = {}
    for names in by_call.values():
        for name in names if len(names) > 1 else ():
            partners[name] = partners.get(name, frozenset()) | (names - {name})
    shapes = {spec.name: spec.shape for spec in run.specs}
    return {
        name: replace(
            _summary(hits, partners.get(name, frozenset())),
            box=run.reads.kept(name, shapes[name]),
        )
        for name, hits in run.hits.items()
    }


def _summary(hits: list[ResolvedName], loaded_with: frozenset[str]) -> ResolvedName:
    """One name's landing place: its first loader call, without an expert id when the model
    spread one checkpoint tensor over several experts (GraniteMoE's stacked experts)."""
    first = replace(hits[0], loaded_with=loaded_with) if loaded_with else hits[0]
    if len(hits) > 1 and len({hit.expert_id for hit in hits}) > 1:
        return replace(first, expert_id=None, expert_weight_name=None)
    return first


def kept_boxes(*resolved: Mapping[str, ResolvedName]) -> dict[str, Box]:
    """The boxes a rank keeps of the names its models resolved (a target model and its
    draft): a name any model loads whole is kept whole, else the box holding every model's."""
    boxes: dict[str, list[Box]] = {}
    whole: set[str] = set()
    for names in resolved:
        for name, hit in names.items():
            if hit.box is None:
                whole.add(name)
            else:
                boxes.setdefault(name, []).append(hit.box)
    return {name: bounding(b) for name, b in boxes.items() if name not in whole}


MTP_LAYER_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
"""Config fields that declare a model's MTP layers: DeepSeek-V3, GLM-4.5, Qwen3-Next, MiMo
(``num_nextn_predict_layers``); Qwen3.5 (``mtp_num_hidden_layers``)."""


@dataclass(frozen=True)
class MtpLayers:
    """The MTP layers a model's config declares: ``count`` of them, after its
    ``num_hidden_layers`` decoder layers."""

    num_hidden_layers: int
    count: int

    @classmethod
    def of(cls, config: object) -> MtpLayers | None:
        """What ``config`` (an HF config) declares; None where it declares no MTP layer."""
        layers = getattr(config, "num_hidden_layers", None)
        counts = [getattr(config, field, None) for field in MTP_LAYER_FIELDS]
        count = next((c for c in counts if isinstance(c, int) and c > 0), 0)
        return cls(layers, count) if isinstance(layers, int) and count else None

    def holds(self, name: str) -> bool:
        """``name`` is one of the declared MTP layers' checkpoint names: ``mtp.*`` (Qwen3-Next,
        Qwen3.5; ``mtp.layers.{i}`` with i < count) or a decoder layer just past the model's
        last one (DeepSeek-V3, GLM-4.5: ``model.layers.{N + i}``, i < count)."""
        parts = name.split(".")
        if "mtp" in parts[:2]:
            index = _layer_index(parts[parts.index("mtp") :])
            return index is None or index < self.count
        index = _layer_index(parts)
        return index is not None and 0 <= index - self.num_hidden_layers < self.count


def _layer_index(parts: Sequence[str]) -> int | None:
    for part, index in zip(parts, parts[1:], strict=False):
        if part == "layers" and index.isdigit():
            return int(index)
    return None


def mtp_names_left(
    specs: Sequence[TensorSpec], loaded: Collection[str], mtp: MtpLayers | None
) -> list[str]:
    """The names among ``specs`` of the MTP layers the config declares (``mtp``) that the model
    does not load (``loaded``): an engine serving without a draft model ignores them (warned
    per version) instead of refusing them, so a trainer that exports MTP is not stuck. Any
    other name the model does not load stays unknown (a layer the model does not have is
    the wrong model, not MTP)."""
    if mtp is None:
        return []
    return [s.name for s in specs if s.name not in loaded and mtp.holds(s.name)]


def refuse_unknown(
    specs: Sequence[TensorSpec], taken: Collection[str], model: object, draft: object = None
) -> None:
    """Raise :func:`unknown_names_error` for the names of ``specs`` not in ``taken`` (loaded by
    ``model`` or its ``draft`` model, or deliberately ignored)."""
    unknown = [spec.name for spec in specs if spec.name not in taken]
    if unknown:
        models = type(model).__name__
        if draft is not None:
            models += f" (nor its draft model {type(draft).__name__})"
        raise unknown_names_error(models, unknown)


def unknown_names_error(models: str, names: Sequence[str]) -> NameResolutionError:
    """The error for checkpoint names no model of an engine loads (``models`` names them)."""
    shown = ", ".join(repr(n) for n in names[:_LISTED])
    more = f" (and {len(names) - _LISTED} more)" if len(names) > _LISTED else ""
    return NameResolutionError(
        f"the live {models} has no tensor for {shown}{more}: its load_weights loads them "
        "nowhere (unknown names, or a tied lm_head that loads through the embedding). Check "
        "the sender's name templates for this architecture, or drop these tensors from the "
        "version."
    )
