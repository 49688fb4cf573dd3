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
from dataclasses import dataclass, replace

import torch

from weightsync.receiver.name_resolver import aliases
from weightsync.receiver.target import Arrival, Batches, TensorBox
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

    def read_dims(self, shape: tuple[int, ...]) -> tuple[list[int | None], list[int]] | None:
        """What this placement reads of a received tensor of ``shape``, as a box of it: for
        each placement dim the tensor dim it walks (None: size 1), and the box's first
        element; None when the read is no box (a stride no single dim of ``shape`` has)."""
        if not shape:
            return None
        contiguous = torch.empty(shape, device="meta").stride()
        first = [int(c) for c in torch.unravel_index(torch.tensor(self.offset), shape)]
        dims: list[int | None] = []
        for n, step in zip(self.size, self.stride, strict=True):
            walks = [k for k, c in enumerate(contiguous) if c == step and shape[k] > 1]
            if n == 1:
                dims.append(None)
            elif len(walks) != 1 or walks[0] in dims or first[walks[0]] + n > shape[walks[0]]:
                return None
            else:
                dims.append(walks[0])
        return dims, first

    def piece_pair(
        self, live: torch.Tensor, piece: TensorBox, read: tuple[list[int | None], list[int]]
    ) -> Pair | None:
        """The copy of what ``piece`` holds of this placement's read (``read``:
        :meth:`read_dims`) straight into the live box; None when it holds none of it."""
        dims, first = read
        lo, hi = list(first), [a + 1 for a in first]
        for d, k in enumerate(dims):
            if k is not None:
                hi[k] = first[k] + self.size[d]
        for k, (a, n) in enumerate(zip(piece.start, piece.data.shape, strict=True)):
            lo[k], hi[k] = max(lo[k], a), min(hi[k], a + n)
            if lo[k] >= hi[k]:
                return None
        src = piece.data[
            tuple(slice(a - p, b - p) for a, b, p in zip(lo, hi, piece.start, strict=True))
        ]
        walked = [k for k in dims if k is not None]
        src = src.permute(walked + [k for k in range(src.dim()) if k not in walked])
        src = src.reshape(src.shape[: len(walked)]) if walked else src.reshape(())
        box = []
        for d, k in enumerate(dims):
            if k is None:
                src = src.unsqueeze(d)
                box.append(slice(self.start[d], self.start[d] + 1))
            else:
                at = self.start[d] + lo[k] - first[k]
                box.append(slice(at, at + hi[k] - lo[k]))
        return live[tuple(box)], src


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
        self._reads_of: dict[str, list | None] = {}

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

    def take_pieces(self, arrival: Arrival) -> Arrival:
        """Replay what ``arrival`` holds of this plan as pieces (forgetting the kept batches
        first when it says its views were replaced); returns it with the pieces left."""
        if arrival.replaced:
            self.forget()
        if not arrival.boxes:
            return arrival
        return replace(arrival, boxes=tuple(self.apply_pieces(arrival.boxes, arrival.key)))

    def apply_pieces(self, pieces: Sequence[TensorBox], key: Hashable = None) -> list[TensorBox]:
        """Replay the pieces of tensors of this plan straight from ``pieces`` (no whole tensor
        assembled), batched as :meth:`apply`; returns the pieces it left (other names, or a
        placement whose read is no box of its tensor)."""
        mine = [p for p in pieces if p.name in self.placements and self._reads(p) is not None]
        if mine:
            self._batches.run(
                ("pieces", key) if key is not None else None,
                lambda: CopyBatch.of(self._piece_copies(mine), reused=key is not None),
            )
        taken = {id(p) for p in mine}
        return [p for p in pieces if id(p) not in taken]

    def _reads(self, piece: TensorBox) -> list | None:
        """What each of the name's placements reads (:meth:`Placement.read_dims`), worked out
        once per name (its tensor's shape is the baked manifest's): None if one is no box."""
        if piece.name not in self._reads_of:
            reads = [p.read_dims(piece.shape) for p in self.placements[piece.name] if not p.zero]
            self._reads_of[piece.name] = None if None in reads else reads
        return self._reads_of[piece.name]

    def _piece_copies(self, pieces: Sequence[TensorBox]) -> list[Pair]:
        pairs, zeroed = [], set()
        for piece in pieces:
            placements = self.placements[piece.name]
            reads = iter(self._reads(piece) or ())
            for p in placements:
                live = self._live[p.live_name]
                if p.zero:
                    if piece.name not in zeroed:
                        pairs.append(p.pair(live, live))
                    continue
                pair = p.piece_pair(live, piece, next(reads))
                if pair is not None:
                    pairs.append(pair)
            zeroed.add(piece.name)
        return pairs

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
