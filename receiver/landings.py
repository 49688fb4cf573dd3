"""Reading a bake's int64 stand-ins (:mod:`.bake`): which input element the loaders put in each
element of a live tensor, as boxes each filled from a strided view of one input
(:class:`~.replay.Placement`), or why no such reading exists (the loaders computed values,
wrote constants other than zero, or scattered an input in an order no strided view reads).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from weightsync.receiver.replay import Placement

BASE = (1 << 41) + 12345
STEP = 1_000_003
CONSTANT_BELOW = 1 << 32
"""Stand-in values below this (in magnitude) are constants or untouched, never an input's."""
SHIFT = 977
"""The second bake's inputs are the first's plus this: an input's element moves with it, a
constant stays, and a value computed from inputs (however small) does neither."""
UNTOUCHED = -1
"""What the first bake's stand-ins start as (the second's: one less, so a loader's constant,
equal in both, is told from an element no loader wrote)."""


def placements(
    live_name: str,
    stand_in: torch.Tensor,
    shifted: torch.Tensor | None,
    inputs: Sequence[tuple[str, int, int]],
) -> list[Placement] | str:
    """Where each input's elements landed in ``stand_in`` (``shifted``: the same loaders'
    result for inputs plus :data:`SHIFT`); see the module docstring."""
    computed = f"the loaders of {live_name!r} compute values, not only move them"
    if shifted is None:
        return computed
    flat = stand_in.data.reshape(-1)
    whole = _whole(live_name, flat, shifted.data.reshape(-1), tuple(stand_in.shape), inputs)
    if whole is not None:
        return [whole]
    moved = (flat >= CONSTANT_BELOW) | (flat <= -CONSTANT_BELOW)
    untouched = flat == UNTOUCHED
    moves = shifted.data.reshape(-1).sub_(flat)  # in place: the second stand-in is not kept
    if bool(((moves != SHIFT) & moved).any() | ((moves != -1) & untouched).any()):
        return computed
    constant = ~moved & ~untouched
    if bool((moves[constant] != 0).any()):
        return computed
    if bool(flat[constant].any()):
        return f"the loaders of {live_name!r} write constants other than 0"
    pos = moved.nonzero().squeeze(1)
    rel = flat[pos] - BASE
    if bool(((rel < 0) | (rel % STEP != 0)).any()):
        return computed
    src = rel // STEP
    starts = torch.tensor([s for _, s, _ in inputs], dtype=torch.int64)
    which = torch.searchsorted(starts, src, right=True) - 1
    shape = tuple(stand_in.shape)
    out: list[Placement] = []
    for j in which.unique().tolist():
        name, start, numel = inputs[j]
        sel = which == j
        offsets = src[sel] - start
        if bool((offsets >= numel).any()):
            return f"{live_name!r} holds values no input had"
        unreadable = f"{name!r} lands in {live_name!r} in an order no strided view reads"
        try:
            boxes = list(_boxes(pos[sel], offsets, shape))
        except _NotABox:
            return unreadable
        for box_start, values in boxes:
            stride = _stride(values)
            if stride is None:
                return unreadable
            first = int(values.reshape(-1)[0])
            out.append(Placement(name, live_name, box_start, tuple(values.shape), first, stride))
    zeros = constant.nonzero().squeeze(1)
    if len(zeros):
        if not out:
            return f"the loaders of {live_name!r} write only constants"
        try:  # the zeros come with the first input placed here (vocab padding: its rows)
            boxes = list(_boxes(zeros, torch.zeros_like(zeros), shape))
        except _NotABox:
            return f"the loaders of {live_name!r} write zeros no box holds"
        for box_start, values in boxes:
            size = tuple(values.shape)
            out.append(
                Placement(out[0].name, live_name, box_start, size, 0, (0,) * len(size), True)
            )
    return out


WHOLE_CHUNK = 1 << 24
"""Elements compared at a time when checking a stand-in is one input, whole (no temporaries
the size of an embedding)."""


def _whole(
    live_name: str,
    flat: torch.Tensor,
    shifted: torch.Tensor,
    shape: tuple[int, ...],
    inputs: Sequence[tuple[str, int, int]],
) -> Placement | None:
    """The placement when ``flat`` is one input's elements, all of them in order (most
    tensors of a TP=1 engine: an embedding, a norm, an unpacked projection); else None."""
    first = int(flat[0]) - BASE if flat.numel() else -1
    if first < 0 or first % STEP:
        return None
    start = first // STEP
    match = [(name, n) for name, at, n in inputs if at == start and n == flat.numel()]
    if not match:
        return None
    for lo in range(0, flat.numel(), WHOLE_CHUNK):
        hi = min(lo + WHOLE_CHUNK, flat.numel())
        want = torch.arange(start + lo, start + hi, dtype=torch.int64).mul_(STEP).add_(BASE)
        if not (torch.equal(flat[lo:hi], want) and torch.equal(shifted[lo:hi], want + SHIFT)):
            return None
    stride = tuple(torch.empty(shape, device="meta").stride())
    return Placement(match[0][0], live_name, (0,) * len(shape), shape, 0, stride)


def _boxes(
    positions: torch.Tensor, offsets: torch.Tensor, shape: tuple[int, ...]
) -> Iterator[tuple[tuple[int, ...], torch.Tensor]]:
    """``positions`` (ascending flat indices of ``shape``) as full boxes, each with the input
    offsets laid out in it: one box, or one per run of consecutive rows (a fused checkpoint
    tensor split into two slots of a packed parameter)."""
    if not shape:
        yield (), offsets.reshape(())
        return
    coords = torch.stack(torch.unravel_index(positions, shape))
    rows = coords[0]
    breaks = ((rows[1:] - rows[:-1]) > 1).nonzero().squeeze(1).add(1).tolist()
    for part in torch.tensor_split(torch.arange(len(positions)), breaks):
        c = coords[:, part]
        lo, hi = c.min(dim=1).values, c.max(dim=1).values
        size = tuple((hi - lo + 1).tolist())
        if math.prod(size) != len(part):
            raise _NotABox
        yield tuple(lo.tolist()), offsets[part].reshape(size)


class _NotABox(Exception):
    pass


def _stride(values: torch.Tensor) -> tuple[int, ...] | None:
    """The strides that read ``values`` (input offsets laid out in a box) from the input, or
    None when no strided view does."""
    if values.numel() == 0:
        return None
    first = values.reshape(-1)[0]
    stride = []
    expected = torch.zeros_like(values) + first
    for d, n in enumerate(values.shape):
        if n == 1:
            stride.append(0)
            continue
        step = int(values.select(d, 1).reshape(-1)[0] - first)
        if step < 0:
            return None
        stride.append(step)
        shape = [1] * values.dim()
        shape[d] = n
        expected = expected + torch.arange(n, dtype=torch.int64).view(shape) * step
    return tuple(stride) if torch.equal(expected, values) else None
