"""Block FP8 as the engines' FP8 checkpoints hold it (DeepSeek-V3's format, which vLLM's and
SGLang's block-FP8 linear layers load): e4m3 values and, per 128 x 128 block, the float32
factor that turns them back (``weight_scale_inv``). Pure tensor code, any device; the sender
side of issue 36 (trainer-side FP8) quantizes with it.

It matches the engines' reference quantizer bit for bit (vLLM's
``vllm.utils.deep_gemm.per_block_cast_to_fp8``, SGLang's of the same name with UE8M0 scales):
block amax in float32 clamped to 1e-4, divided by e4m3's largest value (448), optionally
rounded up to a power of two (UE8M0, what DeepGEMM wants), and each block multiplied by the
reciprocal of its scale before the cast, as they do.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from weightsync import fp8_kernel
from weightsync.buckets import TensorSpec
from weightsync.tensor_keys import SameTensors, layout_key

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
BLOCK = (128, 128)
AMAX_FLOOR = 1e-4
"""A block of zeros still gets a finite scale."""


def quantize_block_fp8(
    weight: torch.Tensor, block: tuple[int, int] = BLOCK, *, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (2-D, any float dtype) as e4m3 values of its shape and the float32
    ``weight_scale_inv`` of shape ``(ceil(rows / block[0]), ceil(cols / block[1]))``: value
    times its block's scale gives back the weight, to e4m3's precision.

    Raises:
        ValueError: ``weight`` is not 2-D or not floating point.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"block FP8 quantizes 2-D float weights, not {tuple(weight.shape)} {weight.dtype}"
        )
    rows, cols = weight.shape
    bm, bn = block
    padded = weight.new_zeros((-(-rows // bm) * bm, -(-cols // bn) * bn))
    padded[:rows, :cols] = weight
    blocks = padded.view(-1, bm, padded.size(1) // bn, bn)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(AMAX_FLOOR)
    scale = amax / FP8_MAX
    if ue8m0:
        scale = _ceil_to_power_of_two(scale)
    values = (blocks * (1.0 / scale)).to(FP8)
    return values.view_as(padded)[:rows, :cols].contiguous(), scale.view(
        blocks.size(0), blocks.size(2)
    )


def dequantize_block_fp8(
    values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK
) -> torch.Tensor:
    """The float32 weight ``values`` and their block scales stand for."""
    rows, cols = values.shape
    scales = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return values.float() * scales[:rows, :cols]


def _ceil_to_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    """Each positive float32 rounded up to a power of two, by its bits (as DeepGEMM does: a
    nonzero mantissa bumps the exponent, kept within the normal range)."""
    bits = scale.abs().float().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = (exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)).clamp(1, 254)
    return (exponent << 23).view(torch.float32)


SCALE_SUFFIX = "weight_scale_inv"


def linear_weight(name: str, tensor: torch.Tensor) -> bool:
    """The default of which tensors an FP8 engine serves in FP8: the 2-D weights of linear
    projections (``*_proj.weight``: attention, MLP, per-expert MLP, DeepSeek's low-rank
    projections), not embeddings, the LM head, norms or MoE routers, as block-FP8 checkpoints
    (DeepSeek-V3, Qwen3-FP8) hold them. Pass your own to :class:`BlockFp8` for other names."""
    return name.endswith("_proj.weight") and tensor.dim() == 2 and tensor.is_floating_point()


class BlockFp8:
    """A trainer's weights in an FP8 engine's checkpoint form, for ``Publisher.publish``: each
    weight ``quantized`` picks becomes e4m3 values under its own name and its block scales
    under ``<module>.weight_scale_inv``; every other tensor passes through. The results are
    views of one buffer per device, kept from call to call while the tensors' names and shapes
    stay (one storage to offer, not one per tensor: a MoE model has thousands), so a trainer
    that publishes every step offers the same memory every time and the sender maps it once.
    Quantizes on the tensors' device (the trainer's GPU): bf16 weights on a GPU with CuPy in
    launches of :mod:`.fp8_kernel` (one read and one write), in the tensors' order and
    :data:`LAUNCH_BYTES` of weights each, others with torch's ops. On GPUs each launch records
    an interprocess event, so a version can begin while the later ones run (:attr:`ready`).

    Args:
        quantized: which tensors to quantize (default :func:`linear_weight`).
        block: the block size the engine's checkpoint uses (``weight_block_size``).
        ue8m0: scales rounded up to powers of two (what DeepGEMM engines want).
    """

    def __init__(
        self,
        quantized=linear_weight,
        block: tuple[int, int] = BLOCK,
        *,
        ue8m0: bool = False,
    ) -> None:
        self.quantized, self.block, self.ue8m0 = quantized, block, ue8m0
        self._key: tuple = ()
        self._views: dict[str, torch.Tensor] = {}
        self._where: tuple = ()
        self._launches: list[tuple[fp8_kernel.Quantize, torch.cuda.Event, tuple[str, ...]]] = []
        self._launched: frozenset[str] = frozenset()
        self._marks: dict[tuple[torch.device, str], torch.cuda.Event] = {}
        """Per GPU, the events recorded before the launches (``inputs``: what passes through
        is written) and after torch's ops (``rest``)."""
        self._ready: dict[str, torch.cuda.Event] | None = None
        self._last: tuple[SameTensors, dict[str, torch.Tensor], list] | None = None
        """(the mapping last given, what it gave, its groups for torch's ops)."""

    def specs(self, specs: Iterable[TensorSpec]) -> tuple[TensorSpec, ...]:
        """What this makes of tensors of ``specs`` (names, dtypes, shapes, in its order),
        worked out on meta tensors by one of the same settings: no memory, no change here.

        Raises:
            ValueError: ``quantized`` picks a spec that is not a 2-D float weight.
        """
        meta = {s.name: torch.empty(s.shape, dtype=s.torch_dtype, device="meta") for s in specs}
        form = BlockFp8(self.quantized, self.block, ue8m0=self.ue8m0)(meta)
        return tuple(TensorSpec.of(name, t) for name, t in form.items())

    @torch.no_grad()
    def __call__(self, tensors) -> dict[str, torch.Tensor]:
        """``tensors`` in the engine's checkpoint form. Given the same mapping again, holding
        the same tensors where they were (a trainer's parameters), it quantizes them again and
        returns the same dict as last time, at once: a MoE model's thousands of tensors are
        not looked at again, and the publisher then knows the dict at once too."""
        last = self._last
        if last is not None and last[0].holds(tensors):
            self._run(last[2])
            return last[1]
        items = list(tensors.items() if hasattr(tensors, "items") else tensors)
        picked = [(name, t) for name, t in items if self.quantized(name, t)]
        for name, t in picked:
            if t.dim() != 2 or not t.is_floating_point():
                raise ValueError(
                    f"block FP8 quantizes 2-D float weights; {name!r} is {tuple(t.shape)} "
                    f"{t.dtype} (the `quantized` predicate picked it)"
                )
        key = tuple((name, tuple(t.shape), t.device) for name, t in picked)
        if key != self._key:
            self._views, self._key = self._allocate(picked), key
            self._where = ()
        self._plan_launches(picked)
        groups = self._groups([(n, t) for n, t in picked if n not in self._launched])
        out: dict[str, torch.Tensor] = {}
        for name, tensor in items:
            if name in self._views:
                out[name] = self._views[name]
                out[scale_name(name)] = self._views[scale_name(name)]
            else:
                out[name] = tensor
        self._ready = self._events(items, out) if all(t.is_cuda for t in out.values()) else None
        self._run(groups)
        self._last = (SameTensors(tensors), out, groups) if isinstance(tensors, Mapping) else None
        return out

    @property
    def ready(self) -> Mapping[str, torch.cuda.Event] | None:
        """For ``Publisher.publish(..., ready=fp8.ready)``: each tensor the last call gave,
        by name, and the interprocess event recorded once it is written (the tensors passed
        through: before the first launch; the quantized ones: after theirs). None where a
        tensor is not on a GPU. The same mapping while the tensors' layout stays."""
        return self._ready

    def last_ready(self, names: Iterable[str]) -> torch.cuda.Event:
        """Of :attr:`ready`'s events for ``names`` (on one GPU), the one recorded last: once
        it fired, all of them did (one stream records them, in this order)."""
        marks = [(what, e) for (_, what), e in self._marks.items()]
        order = [e for what, e in marks if what == "inputs"] + [e for _, e, _ in self._launches]
        rank = {id(e): i for i, e in enumerate(order)}  # "rest" (after torch's ops): last
        assert self._ready is not None
        return max((self._ready[n] for n in names), key=lambda e: rank.get(id(e), len(order)))

    def _events(self, items, out: Mapping[str, torch.Tensor]) -> dict[str, torch.cuda.Event]:
        """:attr:`ready` for ``out``: the last mapping again where its events are the same."""
        by_name = {}
        for _, event, names in self._launches:
            by_name.update(dict.fromkeys(names, event))
        ready = {}
        for name, tensor in items:
            if name not in self._views:
                ready[name] = self._mark(tensor.device, "inputs")
                continue
            event = by_name.get(name) or self._mark(tensor.device, "rest")
            ready[name] = ready[scale_name(name)] = event
        ready = {name: ready[name] for name in out}
        last = self._ready
        same = last is not None and last.keys() == ready.keys()
        return last if same and all(last[n] is e for n, e in ready.items()) else ready

    def _mark(self, device: torch.device, what: str) -> torch.cuda.Event:
        key = (device, what)
        if key not in self._marks:
            self._marks[key] = torch.cuda.Event(interprocess=True)
        return self._marks[key]

    def _run(self, groups) -> None:
        self._record("inputs")
        for launch, event, _ in self._launches:
            launch.run()
            event.record(torch.cuda.current_stream(launch.device))
        for group in groups:
            self._quantize(group)
        self._record("rest")

    def _record(self, what: str) -> None:
        for (device, mark), event in self._marks.items():
            if mark == what:
                event.record(torch.cuda.current_stream(device))

    @property
    def launched(self) -> frozenset[str]:
        """The names the kernel quantized in the last call (the rest went through torch's
        ops)."""
        return self._launched

    def _plan_launches(self, picked) -> None:
        """The kernel's launches (one per GPU) for the picked tensors it can quantize, kept
        while the tensors are at the same addresses (the trainer's parameters are)."""
        where = layout_key(dict(picked))
        if where == self._where:
            return
        by_device: dict[torch.device, list[tuple[str, fp8_kernel.Job]]] = {}
        if self.block == (fp8_kernel.TILE, fp8_kernel.TILE):
            for name, t in picked:
                job = (t, self._views[name], self._views[scale_name(name)])
                if fp8_kernel.fits(*job):
                    by_device.setdefault(t.device, []).append((name, job))
        self._launches = [
            (
                fp8_kernel.Quantize(list(part.values()), ue8m0=self.ue8m0),
                torch.cuda.Event(interprocess=True),
                tuple(part),
            )
            for jobs in by_device.values()
            for part in _parts(jobs)
        ]
        self._launched = frozenset(name for jobs in by_device.values() for name, _ in jobs)
        self._where = where

    def _groups(self, picked) -> list[list[tuple[str, torch.Tensor]]]:
        """Tensors quantized in one go: small ones of one shape, dtype and device that split
        into whole blocks (a MoE model's experts), up to :data:`_GROUP_BYTES` each; any other
        alone. Thousands of small per-tensor launches cost more than their bytes."""
        by_kind: dict[tuple, list] = {}
        for name, t in picked:
            small = t.numel() * t.element_size() < _SMALL_BYTES
            kind = (tuple(t.shape), t.dtype, t.device) if small and self._whole(t) else (name,)
            by_kind.setdefault(kind, []).append((name, t))
        groups = []
        for members in by_kind.values():
            per = max(1, _GROUP_BYTES // (members[0][1].numel() * members[0][1].element_size()))
            groups += [members[i : i + per] for i in range(0, len(members), per)]
        return groups

    def _whole(self, t: torch.Tensor) -> bool:
        return t.shape[0] % self.block[0] == 0 and t.shape[1] % self.block[1] == 0

    def _quantize(self, group: list[tuple[str, torch.Tensor]]) -> None:
        """Quantize ``group`` into its views, as :func:`quantize_block_fp8` does each, in
        fewer passes: no padding where the blocks are whole, the cast written straight into
        the views."""
        names = [name for name, _ in group]
        first = group[0][1]
        if len(group) == 1 and not self._whole(first):
            values, scale = quantize_block_fp8(first, self.block, ue8m0=self.ue8m0)
            self._views[names[0]].copy_(values)
            self._views[scale_name(names[0])].copy_(scale)
            return
        (bm, bn), (rows, cols) = self.block, first.shape
        stacked = first.unsqueeze(0) if len(group) == 1 else torch.stack([t for _, t in group])
        blocks = stacked.contiguous().view(len(group), rows // bm, bm, cols // bn, bn)
        # The largest magnitude is one of the values: taking it before widening is exact.
        amax = blocks.abs().amax(dim=(2, 4), keepdim=True).float().clamp(AMAX_FLOOR)
        scale = amax / FP8_MAX
        if self.ue8m0:
            scale = _ceil_to_power_of_two(scale)
        scaled = (blocks * (1.0 / scale)).view(len(group), rows, cols)
        torch._foreach_copy_([self._views[n] for n in names], list(scaled.unbind(0)))  # the cast
        scale = scale.view(len(group), rows // bm, cols // bn)
        torch._foreach_copy_([self._views[scale_name(n)] for n in names], list(scale.unbind(0)))

    def _allocate(self, picked) -> dict[str, torch.Tensor]:
        """A buffer per device, cut into each quantized tensor's values and scales."""
        shapes: dict[torch.device, list] = {}
        for name, t in picked:
            shapes.setdefault(t.device, []).extend(
                [
                    (name, FP8, tuple(t.shape)),
                    (scale_name(name), torch.float32, scale_shape(t.shape, self.block)),
                ]
            )
        views: dict[str, torch.Tensor] = {}
        for device, parts in shapes.items():
            offsets, at = [], 0
            for _, dtype, shape in parts:
                offsets.append(at)
                at += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
            arena = torch.empty(at, dtype=torch.uint8, device=device)
            for (name, dtype, shape), at in zip(parts, offsets, strict=True):
                nbytes = math.prod(shape) * dtype.itemsize
                views[name] = arena[at : at + nbytes].view(dtype).view(shape)
        return views


def _parts(jobs: list[tuple[str, fp8_kernel.Job]]) -> list[dict[str, fp8_kernel.Job]]:
    """``jobs`` in order, cut into launches of about :data:`LAUNCH_BYTES` of weights each."""
    parts: list[dict[str, fp8_kernel.Job]] = [{}]
    size = 0
    for name, job in jobs:
        if parts[-1] and size >= LAUNCH_BYTES:
            parts.append({})
            size = 0
        parts[-1][name] = job
        size += job[0].numel() * job[0].element_size()
    return parts


LAUNCH_BYTES = 256 << 20
"""Weights quantized per launch: the first bucket's weights are ready after about one (0.1 ms
on an H200), and the launches after it overlap the first buckets' transfer."""
_ALIGN = 256
"""Each view starts on this byte boundary (the buckets' alignment)."""
_GROUP_BYTES = 256 << 20
"""Source bytes quantized in one go at most (its float32 temporaries are twice that)."""
_SMALL_BYTES = 16 << 20
"""Tensors smaller than this are grouped; a larger one goes alone (its launches are cheap
beside its bytes, and stacking would copy it)."""


def scale_shape(shape, block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """The shape of the block scales of a 2-D weight of ``shape``: its grid of blocks."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def scale_name(name: str) -> str:
    """The name of the block scales of weight ``name`` (``...weight`` ->
    ``...weight_scale_inv``), as FP8 checkpoints name them."""
    return name[: -len("weight")] + SCALE_SUFFIX
