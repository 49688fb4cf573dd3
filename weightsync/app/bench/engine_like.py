"""A receiver target shaped like an inference engine: packed parameters, fused experts.

The module's parameters use vLLM's names and packing (``qkv_proj`` = q/k/v rows concatenated,
``gate_up_proj`` = gate/up rows, fused experts ``w13_weight`` ``[E, 2I, H]`` and ``w2_weight``
``[E, H, I]``), so loading an HF checkpoint name means resolving it to a slice of a packed
parameter and copying into that slice: the work an engine's ``load_weights`` does.

The target resolves names by probing the live module (its ``packed_modules_mapping`` and each
packed parameter's ``output_sizes``, as vLLM exposes them), never by a per-model table.

With ``tp > 1`` the model is one engine TP rank and holds vLLM's shard of every parameter
(:func:`engine_shard`: column-parallel rows, row-parallel columns, norms and the router
replicated); loading narrows each received tensor to that shard before the copy, so a rank
reads only the bytes it keeps.

What differs from a real engine (vLLM / SGLang):

- resolved slices are cached per name after the first version; vLLM calls each parameter's
  Python ``weight_loader`` per tensor per version (more CPU overhead per tensor);
- no quantization, no repacking and no ``process_weights_after_loading`` after the last bucket;
- no KV cache or CUDA graphs competing for memory and bandwidth;
- weights are written in place with plain ``copy_`` on the current stream.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from weightsync.app.bench.models import ModelShape
from weightsync.buckets import BucketEntry
from weightsync.dtypes import dtype_name
from weightsync.errors import ConfigError, ManifestMismatchError, NameResolutionError
from weightsync.manifest import VersionManifest
from weightsync.receiver.target import InPlaceTarget
from weightsync.regions import Pair, entry_rows
from weightsync.topology_model import Box

_EXPERT = re.compile(r"^(?P<base>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
_REPLICATED = re.compile(r"(norm\.weight|\.mlp\.gate\.weight)$")


@dataclass(frozen=True)
class EngineShard:
    """The part of an HF tensor one engine TP rank keeps: ``length`` indices of ``dim`` from
    ``start``, or all of it when ``dim`` is None (replicated)."""

    dim: int | None
    start: int = 0
    length: int = 0

    def shape_of(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return shape
        return shape[: self.dim] + (self.length,) + shape[self.dim + 1 :]

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.dim is None else tensor.narrow(self.dim, self.start, self.length)

    def box(self, shape: tuple[int, ...]) -> Box | None:
        """The box of a tensor of ``shape`` this is (None: all of it)."""
        if self.dim is None:
            return None
        start = tuple(self.start if d == self.dim else 0 for d in range(len(shape)))
        return Box(start, self.shape_of(shape))


def engine_shard(name: str, shape: tuple[int, ...], tp: int, rank: int) -> EngineShard:
    """What engine TP rank ``rank`` of ``tp`` keeps of HF tensor ``name``, as vLLM shards it:
    row-parallel layers (``o_proj``, ``down_proj``) split their input columns, norms and the
    MoE router are replicated, every other tensor (q/k/v, gate/up, embeddings, lm_head)
    splits its rows.

    Raises:
        ConfigError: the split dimension is not a multiple of ``tp``.
    """
    if tp == 1 or _REPLICATED.search(name):
        return EngineShard(None)
    dim = len(shape) - 1 if name.endswith(_ROW_PARALLEL) else 0
    if shape[dim] % tp:
        raise ConfigError(
            f"engine TP={tp}: {name!r} dim {dim} ({shape[dim]}) does not split into {tp} parts"
        )
    length = shape[dim] // tp
    return EngineShard(dim, rank * length, length)


class EngineLikeModel(torch.nn.Module):
    """Parameters of ``shape`` as an engine holds them (bf16, packed), filled with ``fill``."""

    packed_modules_mapping = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(
        self,
        shape: ModelShape,
        device: torch.device,
        fill: float = -1.5,
        tp: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__()
        if not 0 <= rank < tp:
            raise ConfigError(f"engine TP rank {rank} is outside 0..{tp - 1}")
        for what, n in (("kv_heads", shape.kv_heads), ("ffn width", shape.ffn_rows)):
            if n % tp:
                raise ConfigError(f"engine TP={tp}: {shape.name}'s {what} {n} does not split")
        self.tp, self.rank = tp, rank
        self._output_sizes: dict[str, tuple[int, ...]] = {}
        h, vocab = shape.hidden, shape.vocab // tp
        q, kv, ffn = shape.q_rows // tp, shape.kv_rows // tp, shape.ffn_rows // tp
        self._device = device  # allocate in place: a 15 GB model must not detour via host

        add = self._add
        add("model.embed_tokens.weight", (vocab, h))
        for i in range(shape.layers):
            p = f"model.layers.{i}"
            add(f"{p}.input_layernorm.weight", (h,))
            add(f"{p}.self_attn.qkv_proj.weight", (q + 2 * kv, h), (q, kv, kv))
            if shape.qkv_bias:
                add(f"{p}.self_attn.qkv_proj.bias", (q + 2 * kv,), (q, kv, kv))
            add(f"{p}.self_attn.o_proj.weight", (h, q))
            if shape.qk_norm:
                add(f"{p}.self_attn.q_norm.weight", (shape.head_dim,))
                add(f"{p}.self_attn.k_norm.weight", (shape.head_dim,))
            add(f"{p}.post_attention_layernorm.weight", (h,))
            if shape.is_moe:
                add(f"{p}.mlp.gate.weight", (shape.experts, h))
                add(f"{p}.mlp.experts.w13_weight", (shape.experts, 2 * ffn, h), (ffn, ffn))
                add(f"{p}.mlp.experts.w2_weight", (shape.experts, h, ffn))
            else:
                add(f"{p}.mlp.gate_up_proj.weight", (2 * ffn, h), (ffn, ffn))
                add(f"{p}.mlp.down_proj.weight", (h, ffn))
        add("model.norm.weight", (h,))
        add("lm_head.weight", (vocab, h))
        with torch.no_grad():
            for param in self.parameters():
                param.fill_(fill)

    def _add(self, name: str, dims: tuple[int, ...], output_sizes: tuple[int, ...] = ()) -> None:
        *path, leaf = name.split(".")
        parent: torch.nn.Module = self
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        data = torch.empty(dims, dtype=torch.bfloat16, device=self._device)
        param = torch.nn.Parameter(data, requires_grad=False)
        parent.register_parameter(leaf, param)
        if output_sizes:
            self._output_sizes[name] = output_sizes

    def output_sizes(self, param_name: str) -> tuple[int, ...]:
        """Row counts of the logical tensors packed into ``param_name`` (empty: not packed)."""
        return self._output_sizes.get(param_name, ())


class EngineLikeTarget(InPlaceTarget):
    """A :class:`~weightsync.receiver.target.WeightTarget` over an :class:`EngineLikeModel`."""

    def __init__(self, model: EngineLikeModel) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.device = next(iter(self.params.values())).device
        self._slices: dict[str, torch.Tensor] = {}
        """Resolved live slices by HF name; never dropped (the bench's parameters never move)."""
        self._shards: dict[str, EngineShard] = {}
        self._kept: dict[str, Box] = {}

    def shard(self, name: str, shape: tuple[int, ...]) -> EngineShard:
        """What this engine rank keeps of HF tensor ``name`` of ``shape``."""
        found = self._shards.get(name)
        if found is None:
            found = self._shards[name] = engine_shard(name, shape, self.model.tp, self.model.rank)
        return found

    def mismatch(
        self, names: Iterable[str], expected: Callable[[str], torch.Tensor], version: int
    ) -> str:
        """Empty when the kept part of every tensor of ``names`` equals version ``version``'s
        (``expected``: the whole tensor by HF name), else which differ (bit for bit)."""
        wrong = []
        for name in names:
            full = expected(name)
            kept = self.shard(name, tuple(full.shape)).of(full)
            if not torch.equal(self.resolve(name).view(torch.int16), kept.view(torch.int16)):
                wrong.append(name)
        return (
            f"version {version}: {len(wrong)} tensor(s) differ, first {wrong[:3]}" if wrong else ""
        )

    def resolve(self, name: str) -> torch.Tensor:
        """The live slice an HF checkpoint tensor ``name`` is loaded into (a view).

        Raises:
            NameResolutionError: the model has no parameter (or packed slice) for ``name``.
        """
        cached = self._slices.get(name)
        if cached is None:
            cached = self._slices[name] = self._resolve(name)
        return cached

    def _resolve(self, name: str) -> torch.Tensor:
        if name in self.params:
            return self.params[name]
        m = _EXPERT.match(name)
        if m:
            e = int(m["e"])
            if m["proj"] == "down":
                return self._param(f"{m['base']}.w2_weight", name)[e]
            fused = f"{m['base']}.w13_weight"
            return self._packed_slice(fused, 0 if m["proj"] == "gate" else 1, name, expert=e)
        prefix, _, leaf = name.rpartition(".")
        parent, _, module = prefix.rpartition(".")
        for packed, parts in self.model.packed_modules_mapping.items():
            if module in parts:
                fused = f"{parent}.{packed}.{leaf}"
                return self._packed_slice(fused, parts.index(module), name)
        raise NameResolutionError(
            f"{name!r} resolves to no parameter of the engine-like model (neither by name, "
            "nor as a packed or expert slice)"
        )

    def _param(self, param_name: str, for_name: str) -> torch.Tensor:
        try:
            return self.params[param_name]
        except KeyError:
            raise NameResolutionError(
                f"{for_name!r} maps to {param_name!r}, which the engine-like model lacks"
            ) from None

    def _packed_slice(
        self, param_name: str, index: int, for_name: str, expert: int | None = None
    ) -> torch.Tensor:
        param = self._param(param_name, for_name)
        sizes = self.model.output_sizes(param_name)
        if index >= len(sizes):
            raise NameResolutionError(f"{param_name!r} has no packed slot for {for_name!r}")
        rows = param if expert is None else param[expert]
        return rows.narrow(0, sum(sizes[:index]), sizes[index])

    def validate(self, manifest: VersionManifest) -> None:
        kept = {}
        for spec in manifest.tensors:
            live = self.resolve(spec.name)
            try:
                keeps = self.shard(spec.name, spec.shape).shape_of(spec.shape)
            except ConfigError as e:
                raise ManifestMismatchError(f"version {manifest.version}: {e}") from None
            if tuple(live.shape) != keeps or live.dtype != spec.torch_dtype:
                of = "" if keeps == spec.shape else f" (this TP rank keeps {keeps} of it)"
                raise ManifestMismatchError(
                    f"version {manifest.version}: tensor {spec.name!r} is {spec.shape} "
                    f"{spec.dtype}{of} but the model holds {tuple(live.shape)} "
                    f"{dtype_name(live.dtype)}"
                )
            box = self.shard(spec.name, spec.shape).box(spec.shape)
            if box is not None:
                kept[spec.name] = box
        self._kept = kept

    def keeps(self) -> dict[str, Box]:
        """Its TP shards, as vLLM's loaders would keep them (declared to the sender)."""
        return self._kept

    def live_tensor(self, name: str) -> torch.Tensor:
        return self.resolve(name)

    def copy_pairs(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> list[Pair]:
        return [(self.resolve(name), self.shard(name, tuple(t.shape)).of(t)) for name, t in tensors]

    def chunk_copies(self, entry: BucketEntry, data: torch.Tensor) -> list[Pair]:
        if self.model.tp == 1:
            return super().chunk_copies(entry, data)
        spec, live = entry.spec, self.resolve(entry.name)
        first, stop = entry_rows(entry)
        rows = data.view(spec.torch_dtype).view((stop - first, *spec.shape[1:]))
        shard = self.shard(entry.name, spec.shape)
        if shard.dim != 0:  # every row of the chunk is kept, possibly some columns of it
            return [(live.narrow(0, first, stop - first), shard.of(rows))]
        lo, hi = max(first, shard.start), min(stop, shard.start + shard.length)
        if lo >= hi:
            return []
        return [(live.narrow(0, lo - shard.start, hi - lo), rows.narrow(0, lo - first, hi - lo))]
