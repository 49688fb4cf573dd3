"""Reading a bake's int64 stand-ins (:mod:`.bake`): which input element the loaders put in each
element of a live tensor, as boxes each filled from a strided view of one input
(:class:`~.replay.Placement`), or why no such reading exists (the loaders computed values,
wrote constants other than zero, or scattered an input in an order no strided view reads).

A stand-in is read in chunks of whole rows of its first dim (:data:`READ_CHUNK` elements, or
one row), the boxes of consecutive chunks merged: reading needs memory for a chunk, not a
multiple of the tensor. The first bake's stand-in is read (:func:`placements`) and freed
before the second's is checked against that reading (:func:`shift_differs`), or, where the
first was refused for another reason, against the first (:func:`moves_differ`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import replace

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


READ_CHUNK = 1 << 23
"""Elements of a stand-in read at a time (whole rows of its first dim: at least one)."""


def computed(live_name: str) -> str:
    return f"the loaders of {live_name!r} compute values, not only move them"


def placements(
    live_name: str, stand_in: torch.Tensor, inputs: Sequence[tuple[str, int, int]]
) -> list[Placement] | str:
    """Where each input's elements landed in ``stand_in`` (the first bake's), or why they
    cannot be read as placements; the second bake's stand-in is checked after
    (:func:`shift_differs`). ``stand_in`` is read, not changed."""
    data = stand_in.data
    shape = tuple(data.shape)
    whole = _whole(live_name, data.reshape(-1), shape, inputs)
    if whole is not None:
        return [whole]
    constants = wrong = False  # the verdicts a whole reading gives before any box
    for _, chunk in _chunks(data):
        moved, untouched = _kinds(chunk)
        constants |= bool(chunk[~moved & ~untouched].any())
        rel = chunk[moved] - BASE
        wrong |= bool(((rel < 0) | (rel % STEP != 0)).any())
    if constants:
        return f"the loaders of {live_name!r} write constants other than 0"
    if wrong:
        return computed(live_name)
    starts = torch.tensor([s for _, s, _ in inputs], dtype=torch.int64)
    placed: dict[int, list[Placement]] = {}
    zeros: list[Placement] = []
    no_zero_box = None
    for row, chunk in _chunks(data):
        at = (row,) + (0,) * (len(shape) - 1)
        part = tuple(chunk.shape)
        chunk = chunk.reshape(-1)
        moved, untouched = _kinds(chunk)
        pos = moved.nonzero().squeeze(1)
        src = (chunk[pos] - BASE) // STEP
        which = torch.searchsorted(starts, src, right=True) - 1
        for j in which.unique().tolist():
            name, start, numel = inputs[j]
            sel = which == j
            offsets = src[sel] - start
            if bool((offsets >= numel).any()):
                return f"{live_name!r} holds values no input had"
            unreadable = f"{name!r} lands in {live_name!r} in an order no strided view reads"
            try:
                boxes = list(_boxes(pos[sel], offsets, part))
            except _NotABox:
                return unreadable
            for box_start, values in boxes:
                stride = _stride(values)
                if stride is None:
                    return unreadable
                first = int(values.reshape(-1)[0])
                box = _moved(box_start, at)
                _add(
                    placed.setdefault(j, []),
                    Placement(name, live_name, box, values.shape, first, stride),
                )
        zero = (~moved & ~untouched).nonzero().squeeze(1)
        if len(zero) and no_zero_box is None:
            try:  # the zeros come with the first input placed here (vocab padding: its rows)
                for box_start, values in _boxes(zero, torch.zeros_like(zero), part):
                    size = tuple(values.shape)
                    box = _moved(box_start, at)
                    _add(zeros, Placement("", live_name, box, size, 0, (0,) * len(size), True))
            except _NotABox:
                no_zero_box = f"the loaders of {live_name!r} write zeros no box holds"
    out = [p for j in sorted(placed) for p in placed[j]]
    if zeros or no_zero_box:
        if not out:
            return f"the loaders of {live_name!r} write only constants"
        if no_zero_box:
            return no_zero_box
        out += [replace(z, name=out[0].name) for z in zeros]
    return out


def shift_differs(
    shifted: torch.Tensor, placed: Sequence[Placement], inputs: Sequence[tuple[str, int, int]]
) -> bool:
    """Whether the second bake's stand-in is not what ``placed`` (the first's reading) gives
    for inputs plus :data:`SHIFT` (zeros where it placed zeros, :data:`UNTOUCHED` - 1 where it
    placed nothing): then the loaders compute. ``shifted`` is overwritten (not kept)."""
    data = shifted.data
    starts = {name: start for name, start, _ in inputs}
    mark = UNTOUCHED - 1
    for p in placed:
        box = tuple(slice(a, a + n) for a, n in zip(p.start, p.size, strict=True))
        dst = data[box]
        rows = max(1, READ_CHUNK // max(1, math.prod(p.size[1:]))) if p.size else 1
        for lo in range(0, p.size[0] if p.size else 1, rows):
            part = dst[lo : lo + rows] if p.size else dst
            if p.zero:
                if bool(part.any()):
                    return True
            else:
                want = torch.full((), p.offset + lo * (p.stride[0] if p.size else 0))
                for d, (n, step) in enumerate(zip(part.shape, p.stride, strict=True)):
                    view = [1] * part.dim()
                    view[d] = n
                    want = want + torch.arange(n, dtype=torch.int64).mul_(step).view(view)
                want = want.add_(starts[p.name]).mul_(STEP).add_(BASE + SHIFT)
                if not torch.equal(part, want.expand(part.shape)):
                    return True
            part.fill_(mark)
    return any(bool((chunk != mark).any()) for _, chunk in _chunks(data))


def moves_differ(stand_in: torch.Tensor, shifted: torch.Tensor) -> bool:
    """Whether some element of the second bake's stand-in did not follow the first's: an
    input's by :data:`SHIFT`, an untouched one by -1, a constant not at all."""
    for (_, first), (_, second) in zip(_chunks(stand_in.data), _chunks(shifted.data), strict=True):
        moved, untouched = _kinds(first)
        moves = second - first
        want = torch.where(moved, SHIFT, torch.where(untouched, -1, 0))
        if not torch.equal(moves, want):
            return True
    return False


def _kinds(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which elements hold an input's value, and which no loader wrote."""
    return (chunk >= CONSTANT_BELOW) | (chunk <= -CONSTANT_BELOW), chunk == UNTOUCHED


def _chunks(data: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """``data`` as views of whole rows of its first dim, about :data:`READ_CHUNK` elements
    each (at least one row), with the first row of each."""
    if data.dim() == 0 or data.numel() == 0:
        yield 0, data
        return
    rows = max(1, READ_CHUNK // max(1, math.prod(data.shape[1:])))
    for lo in range(0, data.shape[0], rows):
        yield lo, data[lo : lo + rows]


def _moved(start: tuple[int, ...], at: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a + b for a, b in zip(start, at, strict=True))


def _add(placed: list[Placement], p: Placement) -> None:
    """Append ``p``, merged into the last of ``placed`` where it carries on that box along the
    first dim (the same box a reading in one piece gives)."""
    q = placed[-1] if placed else None
    if q is not None and q.size and q.name == p.name and q.zero == p.zero:
        n = q.size[0]
        step, rest = divmod(p.offset - q.offset, n)
        if (
            q.start[0] + n == p.start[0]
            and (q.start[1:], q.size[1:], q.stride[1:]) == (p.start[1:], p.size[1:], p.stride[1:])
            and rest == 0
            and step >= 0
            and all(x.size[0] == 1 or x.stride[0] == step for x in (q, p))
        ):
            size = (n + p.size[0],) + q.size[1:]
            placed[-1] = replace(q, size=size, stride=(step,) + q.stride[1:])
            return
    placed.append(p)


WHOLE_CHUNK = 1 << 24
"""Elements compared at a time when checking a stand-in is one input, whole (no temporaries
the size of an embedding)."""


def _whole(
    live_name: str,
    flat: torch.Tensor,
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
        if not torch.equal(flat[lo:hi], want):
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
