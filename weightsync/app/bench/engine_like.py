"""A receiver target shaped like an inference engine: packed parameters, fused experts.

The module's parameters use vLLM's names and packing (``qkv_proj`` = q/k/v rows concatenated,
``gate_up_proj`` = gate/up rows, fused experts ``w13_weight`` ``[E, 2I, H]`` and ``w2_weight``
``[E, H, I]``), so loading an HF checkpoint name means resolving it to a slice of a packed
parameter and copying into that slice: the work an engine's ``load_weights`` does.

The target resolves names by probing the live module (its ``packed_modules_mapping`` and each
packed parameter's ``output_sizes``, as vLLM exposes them), never by a per-model table.

What differs from a real engine (vLLM / SGLang):

- engine TP=1: no per-rank narrowing of the received tensor before the copy;
- resolved slices are cached per name after the first version; vLLM calls each parameter's
  Python ``weight_loader`` per tensor per version (more CPU overhead per tensor);
- no quantization, no repacking and no ``process_weights_after_loading`` after the last bucket;
- no KV cache or CUDA graphs competing for memory and bandwidth;
- weights are written in place with plain ``copy_`` on the current stream.
"""

from __future__ import annotations

import re

import torch

from weightsync.app.bench.models import ModelShape
from weightsync.errors import NameResolutionError
from weightsync.manifest import VersionManifest
from weightsync.receiver.target import InPlaceTarget

_EXPERT = re.compile(r"^(?P<base>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


class EngineLikeModel(torch.nn.Module):
    """Parameters of ``shape`` as an engine holds them (bf16, packed), filled with ``fill``."""

    packed_modules_mapping = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(self, shape: ModelShape, device: torch.device, fill: float = -1.5) -> None:
        super().__init__()
        self._output_sizes: dict[str, tuple[int, ...]] = {}
        h, q, kv, ffn = shape.hidden, shape.q_rows, shape.kv_rows, shape.ffn_rows
        self._device = device  # allocate in place: a 15 GB model must not detour via host

        add = self._add
        add("model.embed_tokens.weight", (shape.vocab, h))
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
        add("lm_head.weight", (shape.vocab, h))
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
        self.check_shapes(manifest)

    def live_tensor(self, name: str) -> torch.Tensor:
        return self.resolve(name)
