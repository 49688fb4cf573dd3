"""Which part of each checkpoint tensor an engine rank keeps, learned from its own loaders.

The loader dry run (:mod:`.loader_dry_run`) feeds every checkpoint name to the model's
``load_weights`` as a META tensor and runs each parameter's real ``weight_loader`` on it. A TP
rank's loader narrows the tensor to its shard before copying it (vLLM's and SGLang's column-
and row-parallel layers, vocab-parallel embeddings, packed ``qkv_proj`` offsets). Meta tensors
keep the storage offset and strides of every view, so the view a loader finally reads says
which box of the checkpoint tensor this rank keeps, with no engine-specific table.

The rule: an op whose result is a view of its input (``narrow``, ``view``, ``t``, indexing)
does not read it; any other op reads its tensor inputs (``copy_``, ``cat``, ``contiguous``,
arithmetic), as does ``__setitem__`` its value. A name's box is the bounding box of every read
of it. What such an op makes (a concatenation, a cast) holds nothing of the input that op did
not read, so its own reads add nothing. Conservative on purpose: a name read nowhere (a loader
that skipped it, or an expert whose dry run was another's) is kept whole, so a declared box may
be larger than what the rank uses, never smaller.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch

from weightsync.topology_model import Box, whole_box

_NO_READ_RESULTS = frozenset({"__setitem__"})
"""Ops that return no tensor but read one: ``param.data[...] = loaded``."""


def storage_key(tensor: torch.Tensor) -> int:
    """An id of the tensor's storage (views share it; meta tensors too)."""
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.untyped_storage()._cdata


def _strides(shape: Sequence[int]) -> list[int]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]


def _unravel(offset: int, shape: Sequence[int], strides: Sequence[int]) -> list[int]:
    return [(offset // s) % n if n else 0 for n, s in zip(shape, strides, strict=True)]


def view_box(view: torch.Tensor, shape: Sequence[int]) -> Box | None:
    """The bounding box of the elements ``view`` covers of a contiguous tensor of ``shape``
    it is a view of (same storage, offset 0); None when it covers none."""
    with torch._C.DisableTorchFunctionSubclass():
        sizes, strides, offset = tuple(view.shape), view.stride(), view.storage_offset()
    if not shape:
        return whole_box(shape)
    if 0 in sizes:
        return None
    base = _strides(shape)
    start = _unravel(offset, shape, base)
    # Each view dim walks one dim of the base (narrow, transpose, select): an exact box.
    extent = [0] * len(shape)
    for n, step in zip(sizes, strides, strict=True):
        if n == 1 or step == 0:
            continue
        dim = next((d for d, s in enumerate(base) if s == step and shape[d] > 1), None)
        if dim is None:
            break
        extent[dim] += n - 1
    else:
        if all(a + e < n for a, e, n in zip(start, extent, shape, strict=True)):
            return Box(tuple(start), tuple(e + 1 for e in extent))
    # Otherwise (flattened or reshaped views): every element lies between the first and the
    # last, so the rows they span, whole below the first dim where they differ, hold them all.
    last = _unravel(
        offset + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True)), shape, base
    )
    split = next((d for d in range(len(shape)) if start[d] != last[d]), None)
    if split is None:
        return Box(tuple(start), (1,) * len(shape))
    lo = (*start[:split], start[split], *[0] * (len(shape) - split - 1))
    size = (*[1] * split, last[split] - start[split] + 1, *shape[split + 1 :])
    return Box(tuple(lo), tuple(size))


def bounding(boxes: Iterable[Box]) -> Box | None:
    """The smallest box holding every one of ``boxes`` (None for none)."""
    boxes = list(boxes)
    if not boxes:
        return None
    ndim = len(boxes[0].start)
    lo = tuple(min(b.start[d] for b in boxes) for d in range(ndim))
    hi = tuple(max(b.stop[d] for b in boxes) for d in range(ndim))
    return Box(lo, tuple(b - a for a, b in zip(lo, hi, strict=True)))


class LoaderReads:
    """The reads of a dry run's inputs: by input name, the boxes read.

    Args:
        inputs: each input tensor by checkpoint name (contiguous, storage offset 0).
    """

    def __init__(self, inputs: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._inputs: dict[int, tuple[str, tuple[int, ...]]] = {}
        for name, tensor in inputs:
            self._inputs[storage_key(tensor)] = (name, tuple(tensor.shape))
        self.boxes: dict[str, list[Box]] = {}
        self._captured: list[tuple[str, Box]] | None = None

    def after(self, name: str, args: object, out: object) -> None:
        """Note the reads of one op (``name``) on ``args`` (traced inputs among them) giving
        ``out``."""
        outs = {storage_key(t) for t in _tensors(out)}
        if not outs and name not in _NO_READ_RESULTS:
            return  # metadata: sizes, strides, dtype
        for tensor in _tensors(args):
            key = storage_key(tensor)
            if key in outs:
                continue  # a view of it, or an in-place op on it
            self.read(tensor, key)

    def read(self, tensor: torch.Tensor, key: int | None = None) -> None:
        hit = self._inputs.get(storage_key(tensor) if key is None else key)
        if hit is None:
            return  # made by an op that read what it needed of the inputs
        name, shape = hit
        box = view_box(tensor, shape)
        if box is not None:
            self.boxes.setdefault(name, []).append(box)
            if self._captured is not None:
                self._captured.append((name, box))

    def add(self, name: str, box: Box) -> None:
        """Note a read found once and reused (an expert's loader run for all of them)."""
        self.boxes.setdefault(name, []).append(box)

    @contextmanager
    def capturing(self) -> Iterator[list[tuple[str, Box]]]:
        """The reads noted inside the block, as they are noted."""
        self._captured, outer = [], self._captured
        try:
            yield self._captured
        finally:
            self._captured = outer

    def input_name(self, tensor: torch.Tensor) -> str | None:
        """The input ``tensor`` is, whole (not a view of part of it), or None."""
        hit = self._inputs.get(storage_key(tensor))
        if hit is None:
            return None
        with torch._C.DisableTorchFunctionSubclass():
            exact = tensor.storage_offset() == 0 and tuple(tensor.shape) == hit[1]
        return hit[0] if exact else None

    def kept(self, name: str, shape: Sequence[int]) -> Box | None:
        """What the rank keeps of ``name``: a box smaller than the tensor, or None (whole)."""
        box = bounding(self.boxes.get(name, ()))
        if box is None or box == whole_box(shape) or math.prod(shape) == 0:
            return None
        return box


def _tensors(tree: object) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]
