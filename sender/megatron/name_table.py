"""Finding the mapping of a Megatron parameter: its name's template, then the one mapping of
its architecture (:mod:`.name_templates`) whose condition holds."""

from __future__ import annotations

import re
from dataclasses import dataclass

from weightsync.errors import PlanError

from .dims import ModelDims
from .name_mapping import Architecture, ParamMapping
from .name_templates import ARCHITECTURES

_CANONICAL = (
    (re.compile(r"^(decoder|mtp)\.layers\.\d+\."), r"\1.layers.{layer}."),
    (re.compile(r"\.local_experts\.\d+\."), ".local_experts.{expert}."),
    (re.compile(r"(\.experts\.linear_fc[12]\.(?:weight|bias))\d+$"), r"\1{expert}"),
)
_LOCAL_EXPERT = re.compile(
    r"\.local_experts\.(\d+)\.|\.experts\.linear_fc[12]\.(?:weight|bias)(\d+)$"
)


def template_of(name: str) -> tuple[str, int | None]:
    """A Megatron name's template and its local expert index (None outside experts)."""
    # Bridge's LoRALinear wraps the base linear as `.to_wrap`; its weights keep their HF rule.
    name = name.replace(".to_wrap.", ".")
    template = name
    for pattern, repl in _CANONICAL:
        template = pattern.sub(repl, template)
    match = _LOCAL_EXPERT.search(name)
    expert = None if match is None else int(match.group(1) or match.group(2))
    return template, expert


@dataclass(frozen=True)
class NameTable:
    """One architecture's mappings, indexed by Megatron template."""

    arch: Architecture
    by_template: dict[str, tuple[ParamMapping, ...]]

    @classmethod
    def of(cls, arch: Architecture) -> NameTable:
        index: dict[str, list[ParamMapping]] = {}
        for template, mapping in arch.mappings():
            index.setdefault(template, []).append(mapping)
        for template, mappings in index.items():
            conditions = [m.when for m in mappings]
            if len(set(conditions)) != len(conditions) or (
                len(conditions) > 1 and None in conditions
            ):
                raise PlanError(f"{arch.model_types[0]}: {template!r} has overlapping mappings")
        return cls(arch, {t: tuple(ms) for t, ms in index.items()})

    def lookup(self, name: str, dims: ModelDims, layer: int | None) -> ParamMapping:
        """The one mapping for Megatron parameter ``name``; PlanError when there is none."""
        template, _ = template_of(name)
        mappings = self.by_template.get(template)
        if not mappings:
            raise PlanError(
                f"Megatron parameter {name!r} has no rule for HF {dims.model_type} models; it "
                "cannot be converted (add a mapping in sender/megatron/name_templates.py)"
            )
        holding = [m for m in mappings if dims.holds(m.when, layer)]
        if len(holding) != 1:
            whens = ", ".join(str(m.when) for m in mappings)
            raise PlanError(
                f"Megatron parameter {name!r} has no HF counterpart in this {dims.model_type} "
                f"config (it exists only when: {whens}; layer {layer}); the Megatron model and "
                "the HF config disagree"
            )
        return holding[0]


_TABLES = {t: NameTable.of(a) for a in ARCHITECTURES for t in a.model_types}
"""Every architecture's table by ``model_type``, built once at import (the templates are data)."""


def name_table(model_type: str) -> NameTable:
    try:
        return _TABLES[model_type]
    except KeyError:
        raise PlanError(
            f"HF model_type {model_type!r} is not supported; supported: {sorted(_TABLES)}"
        ) from None
