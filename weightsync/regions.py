"""Source regions: where each part of an HF tensor lives in trainer memory, and the packer.

A :class:`Region` is a (possibly strided) view of trainer memory that fills one box of an HF
tensor. Whoever holds the regions can pack a bucket without the trainer's help: the
publisher's own pack functions (Megatron pieces, the bench's shards) and the sender, which
maps the regions a publisher offered (``BeginVersion.pieces``) and packs itself, saving a
round trip to the publisher per bucket. Pure tensor code: views and ``copy_`` only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from weightsync import copy_kernel, peer_copies
from weightsync.buckets import BucketEntry
from weightsync.errors import PlanError


@dataclass(frozen=True)
class Region:
    """``source`` (shaped like the box) is the HF tensor's box starting at ``dst_start``."""

    dst_start: tuple[int, ...]
    source: torch.Tensor
    ready: torch.cuda.Event | None = None
    """Recorded by the writer's GPU work once ``source`` holds the box (None: it does now):
    copies from ``source`` wait for it first."""


def entry_rows(entry: BucketEntry) -> tuple[int, int]:
    """The dim-0 row range ``[first, stop)`` an entry covers; PlanError if not whole rows."""
    spec = entry.spec
    if not spec.shape:
        return 0, 1
    row = spec.row_bytes
    if row == 0:
        return 0, spec.shape[0]
    if entry.tensor_offset % row or entry.nbytes % row:
        raise PlanError(
            f"{spec.name!r}: bucket chunk at byte {entry.tensor_offset} (+{entry.nbytes}) is not "
            f"a range of whole rows ({row} bytes each); raise bucket_size_bytes above one row"
        )
    first = entry.tensor_offset // row
    return first, first + entry.nbytes // row


@torch.no_grad()
def pack_regions(buffer: torch.Tensor, entry: BucketEntry, regions: Iterable[Region]) -> None:
    """Copy the parts of ``regions`` that fall in ``entry`` (a tensor or a dim-0 row range of
    it) into ``buffer`` (flat ``uint8``, the bucket). One ``copy_`` per region, no allocation
    (except across GPUs, see :func:`copy_pairs`)."""
    copy_pairs(region_copies(buffer, entry, regions))


# Region sources are views taken under no_grad; narrowing one in grad mode after an in-place
# optimizer step on its parameter (torch.optim's) raises, so narrow under no_grad too.
@torch.no_grad()
def region_copies(
    buffer: torch.Tensor, entry: BucketEntry, regions: Iterable[Region]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(destination, source)`` views :func:`pack_regions` copies: worked out once, they
    can be copied again every version (the views follow the memory, not its contents)."""
    spec = entry.spec
    if entry.nbytes == 0:
        return []
    first, stop = entry_rows(entry)
    raw = buffer[entry.offset : entry.offset + entry.nbytes].view(spec.torch_dtype)
    region_view = raw.view((stop - first, *spec.shape[1:])) if spec.shape else raw.view(())
    if not spec.shape:
        return [(region_view, region.source) for region in regions]
    # The entry's elements in the HF tensor: rows [first, stop) of its box (the whole tensor
    # unless the entry is a box of it), every element of the other dims.
    base = entry.box_start or (0,) * len(spec.shape)
    lo_e = (base[0] + first, *base[1:])
    hi_e = (base[0] + stop, *(b + n for b, n in zip(base[1:], spec.shape[1:], strict=True)))
    pairs = []
    for region in regions:
        src = region.source
        lo = tuple(map(max, lo_e, region.dst_start))
        hi = tuple(min(h, a + n) for h, a, n in zip(hi_e, region.dst_start, src.shape, strict=True))
        if any(a >= b for a, b in zip(lo, hi, strict=True)):
            continue
        dst = region_view
        for dim, (a, b) in enumerate(zip(lo, hi, strict=True)):
            dst = dst.narrow(dim, a - lo_e[dim], b - a)
            src = src.narrow(dim, a - region.dst_start[dim], b - a)
        pairs.append((dst, src))
    return pairs


@torch.no_grad()
def copy_pairs(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    CopyBatch.of(pairs).run()


FOREACH_MAX_BYTES = 4 << 20
"""Without the kernel, copies up to this size go in one ``_foreach_copy_``; larger ones get
their own ``copy_``, which moves contiguous bytes at full bandwidth, where ``_foreach_copy_``'s
fused kernel is slower per byte: launches only matter for small copies."""


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""An integer dtype of each element size, to batch copies bit for bit."""


@dataclass(frozen=True)
class CopyBatch:
    """``(destination, source)`` copies issued with as few launches as possible, so MoE models
    with thousands of tensors pay for bytes, not for a Python loop of launches: same-GPU copies
    of rows of contiguous elements in one launch per GPU where CuPy is installed
    (:mod:`.copy_kernel`: the small and strided ones, and the large ones too in a batch that is
    reused), else the small ones in one ``torch._foreach_copy_`` (fused per dtype on CUDA)
    and the large ones a ``copy_`` each. Build it once and :meth:`run` it
    every version (views follow the memory, not its contents)."""

    dsts: tuple[torch.Tensor, ...]
    srcs: tuple[torch.Tensor, ...]
    one_by_one: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    """Large copies, casts, and copies across devices."""
    chunked: tuple[copy_kernel.ChunkedCopies, ...] = ()
    """One launch per GPU of every copy the kernel takes."""
    peer: peer_copies.PeerCopies | None = None
    """Copies from other GPUs on the copy engines (:mod:`.peer_copies`), queued first so the
    local copies run while they do."""

    @classmethod
    def of(
        cls, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], *, reused: bool = False
    ) -> CopyBatch:
        """The batch of ``pairs``. ``reused``: it will run again (every version), so large
        contiguous copies join the one launch too; its table costs a row per
        :data:`~.copy_kernel.CHUNK_BYTES` to build (4 ms for 15 GB on the CI box), which a
        batch run once would pay every time, where a ``copy_`` each costs nothing to prepare."""
        small, single = [], []
        by_gpu: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        peer = []
        for dst, src in stack_strided(pairs):
            if dst.device != src.device and peer_copies.fits(dst, src):
                peer.append((dst, src))
                continue
            kernel = (
                reused
                or dst.nbytes <= FOREACH_MAX_BYTES
                or not (dst.is_contiguous() and src.is_contiguous())
            )
            if kernel and copy_kernel.fits(dst, src) and copy_kernel.available(dst.device):
                by_gpu.setdefault(dst.device, []).append((dst, src))
                continue
            bits = _BITS.get(dst.element_size())
            batched = (
                bits is not None
                and dst.dtype == src.dtype
                and dst.device == src.device
                and dst.nbytes <= FOREACH_MAX_BYTES
            )
            if batched:
                # As integers: on H200 the fused kernel changed some bf16 bit patterns of
                # random bytes (likely NaN payloads); integer copies move the bits as they are.
                small.append((dst.view(bits), src.view(bits)))
            else:
                single.append((dst, src))
        # Largest first: while the GPU copies the big ones, the launches of the rest are
        # queued behind them, instead of the GPU idling between small copies' launches.
        single.sort(key=lambda pair: pair[0].nbytes, reverse=True)
        chunked = tuple(copy_kernel.ChunkedCopies(p) for p in by_gpu.values())
        return cls(
            tuple(d for d, _ in small),
            tuple(s for _, s in small),
            tuple(single),
            chunked,
            peer_copies.PeerCopies(peer) if peer else None,
        )

    @torch.no_grad()
    def run(self) -> None:
        if self.peer:
            self.peer.start()
        for copies in self.chunked:
            copies.run()
        if self.dsts:
            torch._foreach_copy_(list(self.dsts), list(self.srcs), non_blocking=True)
        for dst, src in self.one_by_one:
            _copy(dst, src)
        if self.peer:
            self.peer.finish()


Pair = tuple[torch.Tensor, torch.Tensor]


def stack_strided(pairs: Iterable[Pair]) -> list[Pair]:
    """``pairs`` with runs of strided copies joined: equal boxes at equal steps in both
    memories (the same column shard of every expert's weight) become one copy with a leading
    dim. A TP=2 trainer's MoE pieces are thousands of such boxes, which neither the one-launch
    kernel (contiguous only) nor ``_foreach_copy_`` batch. Contiguous copies are left as they
    are; so is any run whose destinations would overlap."""
    out: list[Pair] = []
    runs: dict[tuple, list[Pair]] = {}
    for dst, src in pairs:
        if (dst.is_contiguous() and src.is_contiguous()) or dst.device != src.device:
            out.append((dst, src))
            continue
        key = (dst.device, dst.dtype, src.dtype, tuple(dst.shape), tuple(src.shape),
               dst.stride(), src.stride(), _storage(dst), _storage(src))  # fmt: skip
        runs.setdefault(key, []).append((dst, src))
    for group in runs.values():
        group.sort(key=lambda p: p[0].storage_offset())
        start = 0
        while start < len(group):
            stop = _run_end(group, start)
            out.append(_stacked(group[start:stop]) if stop - start > 1 else group[start])
            start = stop
    return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _span(t: torch.Tensor) -> int:
    """Elements from a view's first to one past its last (non-negative strides)."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))


def _run_end(group: list[Pair], start: int) -> int:
    """One past the last pair of the run from ``start``: constant, positive steps in both
    memories, each destination clear of the next."""
    if start + 1 == len(group):
        return start + 1
    (d0, s0), (d1, s1) = group[start], group[start + 1]
    step_d = d1.storage_offset() - d0.storage_offset()
    step_s = s1.storage_offset() - s0.storage_offset()
    if step_d < _span(d0) or step_s <= 0:
        return start + 1
    stop = start + 2
    while stop < len(group):
        d, s = group[stop]
        prev_d, prev_s = group[stop - 1]
        if (d.storage_offset() - prev_d.storage_offset() != step_d
                or s.storage_offset() - prev_s.storage_offset() != step_s):  # fmt: skip
            break
        stop += 1
    return stop


def _stacked(run: list[Pair]) -> Pair:
    (d0, s0), (d1, s1) = run[0], run[1]
    n = len(run)
    views = []
    for first, second in ((d0, d1), (s0, s1)):
        step = second.storage_offset() - first.storage_offset()
        views.append(
            first.as_strided((n, *first.shape), (step, *first.stride()), first.storage_offset())
        )
    return views[0], views[1]


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.device == src.device or (dst.is_contiguous() and src.is_contiguous()):
        dst.copy_(src, non_blocking=True)  # across GPUs: one peer copy over NVLink
        return
    # A strided copy across GPUs into memory this process mapped by CUDA IPC faults (seen on
    # H200: illegal address); a contiguous peer copy, then a local strided copy, does not.
    dst.copy_(src.contiguous().to(dst.device, non_blocking=True), non_blocking=True)


def whole(tensors: Mapping[str, torch.Tensor]) -> dict[str, list[Region]]:
    """Each tensor as the one region of itself."""
    return {name: [Region((0,) * t.dim(), t)] for name, t in tensors.items()}
