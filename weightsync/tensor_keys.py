"""Cheap checks that tensors still describe the same memory, for callers that work out
something per tensor once and reuse it every version (the publisher's placement, ``BlockFp8``'s
kernel launches). A MoE model has thousands of tensors, so per-tensor Python is what these
checks cost: they go a field at a time over all tensors."""

from __future__ import annotations

from collections.abc import Mapping
from operator import attrgetter, is_

import torch


def layout_key(tensors: Mapping[str, torch.Tensor]) -> tuple:
    """Equal while the tensors keep every name, dtype, shape, address and stride. Built a
    field at a time over all tensors (a tuple per tensor cost several times more), with
    strides only of tensors not contiguous (a shape decides a contiguous tensor's addressing,
    and ``stride()`` is slow)."""
    values = list(tensors.values())
    contiguous = tuple(map(torch.Tensor.is_contiguous, values))
    return (
        tuple(tensors),
        tuple(map(attrgetter("dtype"), values)),
        tuple(map(attrgetter("shape"), values)),
        tuple(map(torch.Tensor.data_ptr, values)),
        contiguous,
        tuple(t.stride() for t, c in zip(values, contiguous, strict=True) if not c),
    )


class SameTensors:
    """A mapping as it was: :meth:`holds` while the caller passes that very mapping, holding
    the same tensor objects under the same names at the same addresses (a tensor given new
    memory by ``.data =`` shows there). Cheaper than :func:`layout_key` (no shapes or
    strides), for callers that keep their mapping from version to version."""

    def __init__(self, mapping: Mapping[str, torch.Tensor]) -> None:
        self.mapping = mapping  # held, so its identity is never another's
        self._names = tuple(mapping)
        self._values = tuple(mapping.values())
        self._addresses = tuple(map(torch.Tensor.data_ptr, self._values))

    def holds(self, mapping: object) -> bool:
        if mapping is not self.mapping:
            return False
        values = tuple(self.mapping.values())
        return (
            tuple(self.mapping) == self._names  # as many values as last time, too
            and all(map(is_, values, self._values))
            and tuple(map(torch.Tensor.data_ptr, values)) == self._addresses
        )
