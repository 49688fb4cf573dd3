"""The loader dry run: a model's own ``load_weights`` run over META tensors, every live
parameter's ``weight_loader`` swapped for a recorder, so each loader call says where a
checkpoint name lands (live parameter, shard, expert) while the parameter's real loader checks
the shape on a meta copy. Nothing is written. :mod:`.name_resolver` turns the record into
answers and errors; :mod:`.reads` tracks what of each input the loaders read (a TP shard).
"""

from __future__ import annotations

import gc
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from weightsync.buckets import TensorSpec
from weightsync.receiver.reads import LoaderReads, bounding
from weightsync.topology_model import Box

ShardId = str | int


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


def meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """A meta copy that keeps the tensor's class and attributes (``weight_loader``...)."""
    meta = tensor.data.to("meta")
    meta.__class__ = tensor.__class__
    meta.__dict__ = tensor.__dict__.copy()
    return meta


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


class LoaderSwap:
    """One live parameter while its loader is swapped (the dry run, a bake): the recorder
    installed in its place, and the real loader with a meta stand-in to check against."""

    def __init__(self, name: str, param: torch.Tensor, loading: torch.Tensor) -> None:
        self.name = name
        self.param = param
        # SGLang's and vLLM's parameter classes expose the loader as a read-only property.
        self._via_property = isinstance(getattr(type(param), "weight_loader", None), property)
        self._had_own = "weight_loader" in param.__dict__
        self._original = getattr(param, "weight_loader", None)
        own = getattr(loading, "weight_loader", None)
        self.own_loader = own is not None
        """False: the engine copies it whole (its ``default_weight_loader``)."""
        self.loader = _unwrapped(own or _engine_default_loader)
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


class DryRun:
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
        self.params = [
            LoaderSwap(n, p, (loading or {}).get(n, p)) for n, p in model.named_parameters()
        ]
        # Experts of one fused parameter differ only in their index: one real loader run per
        # (parameter, shard, shape, dtype) checks them all (18k names in a 48x128 MoE), and
        # what it read of its input stands for what the others' would.
        self.checked: dict[tuple[object, ...], tuple[str | None, object, Box | None]] = {}
        self.reads = LoaderReads((s.name, t) for s, t in zip(self.specs, self.inputs, strict=True))

    def _recorder(self, entry: LoaderSwap) -> Callable:
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
        self, entry: LoaderSwap, loaded: torch.Tensor, args: tuple, kwargs: dict
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


def dry_run(
    model: torch.nn.Module,
    specs: Sequence[TensorSpec],
    loading: Mapping[str, torch.Tensor] | None,
) -> DryRun:
    """Run the dry run of ``specs`` through ``model`` (``loading``: per live name, the tensor
    in loading format to check against; default the live parameters)."""
    # Tens of thousands of short-lived objects (one meta tensor per name): without the cyclic
    # collector's passes over them the dry run takes a third less time.
    collecting = gc.isenabled()
    gc.disable()
    try:
        run = DryRun(model, specs, loading)
        run.run()
    finally:
        if collecting:
            gc.enable()
    return run
