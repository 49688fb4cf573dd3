"""Block FP8 from every Megatron rank (issue 36): each rank quantizes the pieces of the HF
tensors it holds, on its own device, and publishes the e4m3 values and their block scales
under the engine's names, as :class:`~weightsync.fp8.BlockFp8` turns the gathered HF
tensors into them. No rank gathers a tensor.

Why per piece is exact: a piece whose box starts on a block boundary in every dim, and ends
on one or at the tensor's edge, holds whole blocks of the HF tensor (its partial blocks are
the tensor's own edge blocks), so quantizing it alone gives exactly those blocks' values and
scales, and its scales are the box of the scale grid its blocks cover. A piece boundary
inside a block (a TP split that is not a multiple of the block) would give that block one
scale per rank where the whole tensor has one: such a layout is refused at planning, naming
the tensor and the piece. Gathering such tensors instead would need the TP group to meet in
a collective every version, which the publisher never joins (a weight sync must not
deadlock with training); the engines refuse the same splits of their own TP (vLLM's
``validate_fp8_block_shape``), and the common ones (head_dim 128, FFN widths multiples of
128 x TP) never hit it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from weightsync.buckets import TensorSpec
from weightsync.dtypes import dtype_name
from weightsync.errors import PlanError
from weightsync.fp8 import FP8, BlockFp8, scale_name, scale_shape
from weightsync.regions import Region

from .pieces import CopyPiece
from .plan import RankPlan

Regions = dict[str, list[Region]]


class RankFp8:
    """The FP8 form of one rank's part of every version, for ``MegatronPublisher(fp8=...)``.

    Args:
        fp8: which HF tensors to quantize (its ``quantized``, asked with a meta tensor of
            the HF name's shape and dtype), the block size and scale rounding; only its
            settings are used, not its buffers.
    """

    def __init__(self, fp8: BlockFp8) -> None:
        self.settings = fp8
        # Quantizes this rank's pieces into buffers kept across versions, as BlockFp8 keeps
        # the whole tensors': one per device, offered to the sender once.
        self._pieces = BlockFp8(lambda name, t: True, fp8.block, ue8m0=fp8.ue8m0)
        self._wired: frozenset[str] = frozenset()
        """The quantized tensors' names (learnt by :meth:`check`)."""
        self._taken: tuple[Regions, Regions, dict[str, torch.Tensor], Regions, Regions] | None
        self._taken = None
        """(offered, packed, the pieces to quantize by key, offered and packed quantized)."""
        self._written: torch.cuda.Event | None = None
        """Recorded before each quantization: what passes through is written by then."""
        self._ready: tuple[Regions, dict[str, torch.cuda.Event]] | None = None

    def picks(self, spec: TensorSpec) -> bool:
        """Whether HF tensor ``spec`` travels as block FP8.

        Raises:
            PlanError: the predicate picked a tensor that is not a 2-D float weight.
        """
        meta = torch.empty(spec.shape, dtype=spec.torch_dtype, device="meta")
        if not self.settings.quantized(spec.name, meta):
            return False
        if len(spec.shape) != 2 or not spec.torch_dtype.is_floating_point:
            raise PlanError(
                f"block FP8 quantizes 2-D float weights; HF tensor {spec.name!r} is "
                f"{spec.shape} {spec.dtype} (the `quantized` predicate picked it)"
            )
        return True

    def wire(self, spec: TensorSpec) -> tuple[TensorSpec, ...]:
        """``spec`` as it travels: itself, or its e4m3 values and float32 block scales."""
        if not self.picks(spec):
            return (spec,)
        return (
            TensorSpec(spec.name, dtype_name(FP8), spec.shape),
            TensorSpec(
                scale_name(spec.name),
                dtype_name(torch.float32),
                scale_shape(spec.shape, self.settings.block),
            ),
        )

    def check(self, plan: RankPlan) -> None:
        """Learn which of ``plan``'s tensors are quantized, and check that every piece this
        rank holds of one covers whole blocks.

        Raises:
            PlanError: naming the HF tensor, the Megatron parameter, its piece and the block.
        """
        self._wired = frozenset(spec.name for spec in plan.manifest if self.picks(spec))
        held: dict[str, list[CopyPiece]] = {}
        for by_name in (plan.pieces, plan.copies):
            for name, pieces in by_name.items():
                held.setdefault(name, []).extend(pieces)
        for spec in plan.manifest:
            for piece in held.get(spec.name, ()) if spec.name in self._wired else ():
                box = piece.dst_box(spec.shape)
                if self._cuts_blocks(box, spec.shape):
                    shard = plan.shards.get(piece.shard_key)
                    (r0, r1), (c0, c1) = box
                    bm, bn = self.settings.block
                    raise PlanError(
                        f"block FP8: HF tensor {spec.name!r} {spec.shape} gets rows {r0}:{r1} "
                        f"and columns {c0}:{c1} from Megatron parameter "
                        f"{shard.name if shard else piece.shard_key!r} on this rank, a "
                        f"{r1 - r0} x {c1 - c0} piece whose edge cuts the {bm} x {bn} blocks, "
                        "so its scales would not be the whole tensor's; use a TP size that "
                        "splits it into multiples of the block, or leave it unquantized "
                        "(BlockFp8(quantized=...))"
                    )

    def _cuts_blocks(self, box: Sequence[tuple[int, int]], shape: Sequence[int]) -> bool:
        """Whether a piece at ``box`` starts, or ends short of the tensor's edge, inside a
        block."""
        return any(
            start % block or (stop % block and stop != size)
            for (start, stop), block, size in zip(box, self.settings.block, shape, strict=True)
        )

    @torch.no_grad()
    def quantize(self, offered: Regions, packed: Regions) -> tuple[Regions, Regions]:
        """Quantize this rank's pieces of the quantized tensors now (every version), and give
        ``offered`` and ``packed`` with those tensors' regions replaced by regions of the
        values and the scales. ``packed``'s pieces are among ``offered``'s; both come as new
        mappings when the trainer's memory moved, and the result is kept while they stay."""
        device = next((r.source.device for rs in offered.values() for r in rs), None)
        if device is not None and device.type == "cuda":
            if self._written is None:
                self._written = torch.cuda.Event(interprocess=True)
            self._written.record(torch.cuda.current_stream(device))
        taken = self._taken
        if taken is None or taken[0] is not offered or taken[1] is not packed:
            sources = {
                _key(name, region): region.source
                for name, regions in offered.items()
                if name in self._wired
                for region in regions
            }
            # The first call allocates the kept buffers; their views stay while the sources'
            # shapes and devices do, which they do while these mappings stay.
            views = self._pieces(sources) if sources else {}
            taken = (
                offered,
                packed,
                sources,
                self._swap(offered, views),
                self._swap(packed, views),
            )
            self._taken = taken
        elif taken[2]:
            self._pieces(taken[2])
        return taken[3], taken[4]

    def ready(self) -> dict[str, torch.cuda.Event] | None:
        """For the last :meth:`quantize` (on a GPU; else None), each tensor's event, for
        ``publish(..., ready=)``: a quantized tensor's (values and scales) the last launch
        that writes one of this rank's pieces of it, any other's the event recorded before
        the quantization. The same mapping while the regions stay."""
        taken = self._taken
        if taken is None or self._written is None or self._pieces.ready is None:
            return None
        if self._ready is None or self._ready[0] is not taken[3]:
            ready = dict.fromkeys(taken[3], self._written)
            for name, regions in taken[0].items():
                if name in self._wired:
                    keys = [_key(name, r) for r in regions]
                    last = self._pieces.last_ready(keys + [scale_name(k) for k in keys])
                    ready[name] = ready[scale_name(name)] = last
            self._ready = (taken[3], ready)
        return self._ready[1]

    def _swap(self, regions: Regions, views: Mapping[str, torch.Tensor]) -> Regions:
        """``regions`` with each quantized tensor's regions as regions of its values and of
        its scales."""
        out: Regions = {}
        for name, rs in regions.items():
            if name not in self._wired:
                out[name] = rs
                continue
            out[name] = [Region(r.dst_start, views[_key(name, r)]) for r in rs]
            out[scale_name(name)] = [
                Region(self._block_of(r.dst_start), views[scale_name(_key(name, r))]) for r in rs
            ]
        return out

    def _block_of(self, start: Sequence[int]) -> tuple[int, ...]:
        return tuple(a // b for a, b in zip(start, self.settings.block, strict=True))


def _key(name: str, region: Region) -> str:
    """A piece's name for the piece quantizer: ends like its tensor's name (``...weight``),
    so its scales' key ends ``...weight_scale_inv``."""
    return f"{region.dst_start}/{name}"
