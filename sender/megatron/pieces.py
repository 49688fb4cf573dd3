"""Copy pieces and the packer that writes them straight into a bucket.

A :class:`CopyPiece` says how one rectangular part of one local Megatron shard lands in one
HF tensor. :func:`pack_pieces` copies the pieces of one bucket entry (a whole HF tensor or a
dim-0 row range of it) from the live shards into the bucket buffer, through
:func:`~weightsync.regions.pack_regions`; :func:`piece_regions` gives the same views to a
publisher that offers them to the sender.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from weightsync.buckets import BucketEntry, TensorSpec
from weightsync.errors import PlanError
from weightsync.regions import Region, pack_regions

Narrow = tuple[int, int, int]
"""``(dim, start, length)``: ``tensor.narrow(dim, start, length)``."""


@dataclass(frozen=True)
class CopyPiece:
    """One shard region -> one HF tensor region (same number of elements, same order).

    The source region is ``shard.view(src_view).transpose(*src_transpose)`` (each only when
    set) narrowed by ``src``; the destination region is the HF tensor narrowed by ``dst``.
    The source region is viewed as the destination region's shape before copying (the two
    differ only for layouts that fold experts into one tensor, e.g. a leading 1).
    """

    shard_key: str
    """:attr:`~weightsync.sender.megatron.shards.ShardMeta.key` of the source shard."""
    src: tuple[Narrow, ...] = ()
    dst: tuple[Narrow, ...] = ()
    src_view: tuple[int, ...] | None = None
    src_transpose: tuple[int, int] | None = None

    def dst_box(self, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` per dim of the destination region inside an HF tensor of ``shape``."""
        box = [(0, n) for n in shape]
        for dim, start, length in self.dst:
            box[dim] = (start, start + length)
        return tuple(box)

    @property
    def is_whole(self) -> bool:
        """True when the piece is the whole shard copied onto the whole HF tensor."""
        return not (self.src or self.dst or self.src_view or self.src_transpose)


def source_region(piece: CopyPiece, shard: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The piece's source region as a view of ``shard``, shaped like the destination region."""
    src = shard
    if piece.src_view is not None:
        src = src.view(piece.src_view)
    if piece.src_transpose is not None:
        src = src.transpose(*piece.src_transpose)
    for dim, start, length in piece.src:
        src = src.narrow(dim, start, length)
    if tuple(src.shape) != shape:
        src = src.view(shape)
    return src


@torch.no_grad()
def pack_pieces(
    buffer: torch.Tensor,
    entry: BucketEntry,
    pieces: Sequence[CopyPiece],
    shards: Mapping[str, torch.Tensor],
) -> None:
    """Copy this rank's ``pieces`` of ``entry``'s tensor (or chunk) into ``buffer``.

    Args:
        buffer: the flat ``uint8`` bucket buffer the entry's ``offset`` refers to.
        entry: one bucket entry; a chunk must be a dim-0 row range of the HF tensor.
        pieces: this rank's pieces of that HF tensor (:attr:`RankPlan.pieces`).
        shards: this rank's live shard tensors by shard key.

    Raises:
        PlanError: a chunk that is not whole rows, a missing shard, or a piece that does not
            fit the shard.
    """
    if pieces:
        pack_regions(buffer, entry, piece_regions(entry.spec, pieces, shards))


def piece_regions(
    spec: TensorSpec, pieces: Sequence[CopyPiece], shards: Mapping[str, torch.Tensor]
) -> list[Region]:
    """The pieces of HF tensor ``spec`` as views of the live ``shards``.

    Raises:
        PlanError: a missing shard, or a piece that does not fit the shard.
    """
    regions = []
    for piece in pieces:
        try:
            shard = shards[piece.shard_key]
        except KeyError:
            raise PlanError(
                f"{spec.name!r}: shard {piece.shard_key!r} is not registered on this rank"
            ) from None
        box = piece.dst_box(spec.shape)
        try:
            src = source_region(piece, shard, tuple(b - a for a, b in box))
        except RuntimeError as e:
            raise PlanError(
                f"{spec.name!r}: shard {piece.shard_key!r} {tuple(shard.shape)} does not fit its "
                f"planned piece ({e}); re-plan after the layout changed"
            ) from None
        regions.append(Region(tuple(a for a, _ in box), src))
    return regions


def box_volume(box: tuple[tuple[int, int], ...]) -> int:
    return math.prod(stop - start for start, stop in box)


def boxes_overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> bool:
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
