"""Replay: a version's tensors applied as batched strided copies straight into the live tensors,
at the places a bake (:mod:`.bake`) found the model's own loaders put them.

:meth:`ReplayPlan.copies` turns a bucket's tensors into ``(live box, strided view of the
received tensor)`` pairs for :class:`~weightsync.regions.CopyBatch`. The plan holds the live
tensors it writes and their storage, shape and strides: :meth:`ReplayPlan.stale` names the
first that changed (sleep/wake, a re-allocation), and the owner bakes again before writing.
Only layers the engine serves exactly as loaded are replayed (:func:`modules_as_loaded`, with
each engine's rule of what it processes after loading).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from weightsync.receiver.name_resolver import aliases
from weightsync.receiver.target import Batches
from weightsync.regions import CopyBatch, Pair


@dataclass(frozen=True)
class Placement:
    """A box of live tensor ``live_name`` filled from received tensor ``name``: the box's
    element at index ``j`` is the received (contiguous) tensor's flat element
    ``offset + sum(j[d] * stride[d])``."""

    name: str
    live_name: str
    start: tuple[int, ...]
    size: tuple[int, ...]
    offset: int
    stride: tuple[int, ...]
    zero: bool = False
    """Zeros, not the received tensor: what the loaders write beside it (vocab padding)."""

    def pair(self, live: torch.Tensor, received: torch.Tensor) -> Pair:
        box = tuple(slice(a, a + n) for a, n in zip(self.start, self.size, strict=True))
        dst = live[box] if tuple(live.shape) != self.size else live
        if self.zero:
            return dst, live.new_zeros(()).expand(self.size)
        received = received.contiguous()
        src = received.as_strided(self.size, self.stride, received.storage_offset() + self.offset)
        return dst, src


def modules_as_loaded(
    model: torch.nn.Module, processed: Callable[[torch.nn.Module], bool]
) -> set[str]:
    """The names of the modules whose tensors the engine serves exactly as its loaders wrote
    them: neither ``processed`` after loading nor inside a module that is (attention layers
    process, and may derive from, what they hold), nor holding a tensor tied to a processed
    module's (vLLM-CPU repacks a tied lm_head while the embedding may stay plain)."""
    excluded: set[int] = set()
    for module in model.modules():
        if processed(module):
            excluded.update(id(m) for m in module.modules())
    as_loaded = {
        name
        for name, module in model.named_modules(remove_duplicate=False)
        if id(module) not in excluded
    }
    for live_name, others in aliases(model).items():
        if any(other.rpartition(".")[0] not in as_loaded for other in others):
            as_loaded.discard(live_name.rpartition(".")[0])
    return as_loaded


def _fingerprint(tensor: torch.Tensor) -> tuple:
    return (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


class ReplayPlan:
    """The placements of every replayed name and the live tensors they write."""

    def __init__(
        self, placements: Mapping[str, list[Placement]], live: Mapping[str, torch.Tensor]
    ) -> None:
        self.placements = dict(placements)
        used = {p.live_name for ps in self.placements.values() for p in ps}
        self._live = {name: live[name] for name in used}
        self._prints = {name: _fingerprint(t) for name, t in self._live.items()}
        self._batches = Batches()

    def __contains__(self, name: str) -> bool:
        return name in self.placements

    def copies(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> list[Pair]:
        """The copies that replay ``tensors`` (names of this plan) into the live tensors."""
        return [
            p.pair(self._live[p.live_name], tensor)
            for name, tensor in tensors
            for p in self.placements[name]
        ]

    def apply(self, tensors: Sequence[tuple[str, torch.Tensor]], key: Hashable = None) -> None:
        """Replay ``tensors`` (names of this plan). ``key``: they are views that are the same
        objects whenever it comes again (:attr:`~.target.Arrival.key`), so their batch is
        built once."""
        self._batches.run(key, lambda: CopyBatch.of(self.copies(tensors), reused=key is not None))

    def forget(self) -> None:
        """The views of the keyed batches are not coming again."""
        self._batches.clear()

    def stale(self, live: Mapping[str, torch.Tensor]) -> str | None:
        """The first live tensor the plan writes that is no longer where it was baked."""
        for name, print_ in self._prints.items():
            now = live.get(name)
            if now is None or _fingerprint(now) != print_:
                return name
        return None
