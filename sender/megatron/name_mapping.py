"""The data of the name templates: :class:`ParamMapping` (which rule turns a Megatron parameter,
under any of its spellings, into which HF tensors) and :class:`Architecture` (an architecture's
mappings, before, per and after the decoder layers). The mappings themselves are in
:mod:`.name_blocks` and :mod:`.name_templates`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from weightsync.errors import PlanError

from .dims import CONDITIONS, ModelDims
from .rules import Rule


@dataclass(frozen=True)
class ParamMapping:
    megatron: tuple[str, ...]
    """Megatron name templates (all spellings of this tensor)."""
    rule: Rule
    when: str | None = None
    """A :data:`~weightsync.sender.megatron.dims.CONDITIONS` name; the mapping applies only
    where it holds for the HF config (and layer)."""

    def __post_init__(self) -> None:
        if self.when is not None and self.when not in CONDITIONS:
            raise PlanError(f"mapping {self.megatron[0]!r}: unknown condition {self.when!r}")

    @property
    def is_expert(self) -> bool:
        """Expert params are split over expert-TP and replicated over expert-DP."""
        return any("{expert}" in m or ".experts.weight" in m for m in self.megatron)


@dataclass(frozen=True)
class Architecture:
    model_types: tuple[str, ...]
    read_dims: Callable[[object], ModelDims]
    pre: tuple[ParamMapping, ...]
    """Before the layers (embedding), in HF manifest order."""
    layer: tuple[ParamMapping, ...]
    """Per decoder layer (``decoder.layers.{layer}.`` is implied), in HF manifest order."""
    post: tuple[ParamMapping, ...]
    """After the layers (final norm, output layer)."""
    mtp: tuple[ParamMapping, ...] = ()
    """MTP-only tensors (``mtp.layers.{layer}.`` implied); the MTP layer's
    ``transformer_layer`` uses the ``layer`` mappings. Empty: the architecture has no MTP."""

    def mappings(self) -> tuple[tuple[str, ParamMapping], ...]:
        """Every (full Megatron template, mapping)."""
        out = [(m, p) for p in self.pre + self.post for m in p.megatron]
        out += [("decoder.layers.{layer}." + m, p) for p in self.layer for m in p.megatron]
        if self.mtp:
            out += [("mtp.layers.{layer}." + m, p) for p in self.mtp for m in p.megatron]
            mtp_layer = "mtp.layers.{layer}.transformer_layer."
            out += [(mtp_layer + m, p) for p in self.layer for m in p.megatron]
        return tuple(out)
