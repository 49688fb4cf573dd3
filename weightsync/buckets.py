"""The bucket wire format: planning named tensors into size-capped, 256-byte aligned buckets.

Pure code: no I/O, no transports. A :class:`BucketPlan` is computed once per manifest and
reused for every version with the same manifest. Packing and unpacking work on flat ``uint8``
buffers (CPU or CUDA) and never allocate per tensor.

Rules (one planner, one rule for oversize tensors):

- Tensors are placed in manifest order, each at an offset aligned to ``ALIGNMENT_BYTES``.
- A tensor that does not fit in the current bucket's free space starts a new bucket.
- A tensor larger than the cap is split into chunks. Chunks end on dim-0 row boundaries when a
  row fits in the cap (so a chunk is a row range and packers can copy row slices), otherwise
  on plain byte boundaries. Each chunk is placed like an ordinary tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from weightsync.config import ALIGNMENT_BYTES, DEFAULT_BUCKET_SIZE_BYTES, check_bucket_size
from weightsync.dtypes import dtype_from_name, dtype_name, itemsize
from weightsync.errors import PlanError


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor as the manifest announces it."""

    name: str
    """The HF (checkpoint) name, e.g. ``model.layers.0.self_attn.q_proj.weight``."""
    dtype: str
    """Wire dtype name (see :mod:`weightsync.dtypes`)."""
    shape: tuple[int, ...]

    # Derived once, at construction: an MoE version has thousands of specs, whose sums and
    # checks run every version (``cached_property`` takes a lock per first read on 3.11).
    torch_dtype: torch.dtype = field(init=False, repr=False, compare=False)
    numel: int = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise PlanError("a tensor spec has an empty name")
        dtype = dtype_from_name(self.dtype)
        if any(d < 0 for d in self.shape):
            raise PlanError(f"tensor {self.name!r} has a negative dimension in shape {self.shape}")
        numel = math.prod(self.shape)
        object.__setattr__(self, "torch_dtype", dtype)
        object.__setattr__(self, "numel", numel)
        object.__setattr__(self, "nbytes", numel * itemsize(dtype))

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))

    @property
    def row_bytes(self) -> int:
        """Bytes of one dim-0 row (the whole tensor for scalars)."""
        if not self.shape:
            return self.nbytes
        return math.prod(self.shape[1:]) * itemsize(self.torch_dtype)


@dataclass(frozen=True)
class BucketEntry:
    """One tensor, or one chunk of a tensor, inside a bucket."""

    spec: TensorSpec
    offset: int
    """Byte offset inside the bucket (aligned)."""
    nbytes: int
    """Bytes of this entry (the chunk's bytes for a chunk)."""
    tensor_offset: int = 0
    """Byte offset of this chunk inside the whole tensor's contiguous bytes."""
    chunk_index: int = 0
    num_chunks: int = 1
    source: int = 0
    """Direct buckets only: which of the publisher's storages ``offset`` points into."""
    box_start: tuple[int, ...] = ()
    """Set: the entry is a box of tensor ``name`` (what one engine rank keeps), starting here
    in the tensor, shaped like ``spec`` (the box's shape; its name and dtype are the
    tensor's). Chunks are then chunks of the box."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def is_chunked(self) -> bool:
        return self.num_chunks > 1


@dataclass(frozen=True)
class Bucket:
    index: int
    entries: tuple[BucketEntry, ...]
    nbytes: int
    """Bytes used, rounded up to the alignment (what the checksum covers)."""
    is_last: bool

    @cached_property
    def gaps(self) -> torch.Tensor:
        """The offsets of the bytes in ``[0, nbytes)`` no entry covers (alignment padding),
        for one ``index_fill_``: a packer that writes only its entries zeroes them, so the
        bucket's bytes, and its checksum, depend on its tensors alone (a catch-up compares
        them with the version as published)."""
        ranges, at = [], 0
        for entry in sorted(self.entries, key=lambda e: e.offset):
            if entry.offset > at:
                ranges.append(torch.arange(at, entry.offset))
            at = max(at, entry.offset + entry.nbytes)
        if self.nbytes > at:
            ranges.append(torch.arange(at, self.nbytes))
        return torch.cat(ranges) if ranges else torch.empty(0, dtype=torch.int64)

    @cached_property
    def _gaps_on(self) -> dict[torch.device, torch.Tensor]:
        """:attr:`gaps` copied to each device once: a plan's buckets come again every
        version, and a copy from pageable memory each time waits for the host."""
        return {}

    def zero_gaps(self, buffer: torch.Tensor) -> None:
        """Zero the padding of this bucket in ``buffer`` (:attr:`gaps`)."""
        if len(self.gaps):
            gaps = self._gaps_on.get(buffer.device)
            if gaps is None:
                gaps = self._gaps_on[buffer.device] = self.gaps.to(buffer.device)
            buffer.index_fill_(0, gaps, 0)


@dataclass(frozen=True)
class BucketPlan:
    manifest: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]
    bucket_size_bytes: int
    total_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_bytes", sum(s.nbytes for s in self.manifest))


def align_up(n: int, alignment: int = ALIGNMENT_BYTES) -> int:
    return (n + alignment - 1) // alignment * alignment


def check_manifest(specs: Sequence[TensorSpec]) -> None:
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise PlanError(f"tensor {spec.name!r} appears twice in the manifest")
        seen.add(spec.name)


def _chunks(spec: TensorSpec, cap: int) -> list[tuple[int, int]]:
    """(tensor_offset, nbytes) pieces of a tensor, each at most ``cap`` bytes."""
    total = spec.nbytes
    if total <= cap:
        return [(0, total)]
    row = spec.row_bytes
    step = (cap // row) * row if 0 < row <= cap else cap
    return [(start, min(step, total - start)) for start in range(0, total, step)]


def plan_buckets(
    specs: Iterable[TensorSpec],
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES,
    *,
    first_index: int = 0,
    box_starts: Mapping[str, tuple[int, ...]] | None = None,
) -> BucketPlan:
    """Plan ``specs`` (in order) into buckets of at most ``bucket_size_bytes``, indexed from
    ``first_index``. ``box_starts``: the specs named there are boxes of their tensors, starting
    there (:attr:`BucketEntry.box_start`).

    Raises:
        PlanError: duplicate names. ConfigError: a cap that is not a multiple of 256.
    """
    cap = check_bucket_size(bucket_size_bytes)
    manifest = tuple(specs)
    check_manifest(manifest)
    box_starts = box_starts or {}
    buckets: list[list[BucketEntry]] = [[]]
    used = 0
    for spec in manifest:
        pieces = _chunks(spec, cap)
        for chunk_index, (tensor_offset, nbytes) in enumerate(pieces):
            offset = align_up(used)
            if offset + nbytes > cap and buckets[-1]:
                buckets.append([])
                offset = 0
            buckets[-1].append(
                BucketEntry(
                    spec,
                    offset,
                    nbytes,
                    tensor_offset,
                    chunk_index,
                    len(pieces),
                    box_start=box_starts.get(spec.name, ()),
                )
            )
            used = offset + nbytes
    if not buckets[-1] and len(buckets) > 1:
        buckets.pop()
    out = []
    for i, entries in enumerate(buckets):
        end = max((e.offset + e.nbytes for e in entries), default=0)
        last = i == len(buckets) - 1
        out.append(Bucket(first_index + i, tuple(entries), align_up(end), last))
    return BucketPlan(manifest, tuple(out), cap)


def plan_direct(
    located: Sequence[tuple[TensorSpec, int, int, tuple[int, ...]]], index: int, is_last: bool
) -> Bucket:
    """A direct bucket: ``(spec, source, offset, box_start)`` entries read in place from the
    publisher (``box_start`` set: ``spec`` is the box of the tensor starting there, a piece).

    Nothing is staged, so there is no cap and no chunking; ``nbytes`` is the payload size.
    """
    entries = tuple(direct_entry(*where) for where in located)
    return Bucket(index, entries, sum(e.nbytes for e in entries), is_last)


def direct_entry(
    spec: TensorSpec, source: int, offset: int, box_start: tuple[int, ...] = ()
) -> BucketEntry:
    """One entry of a direct bucket (:func:`plan_direct`)."""
    return BucketEntry(spec, offset, spec.nbytes, source=source, box_start=box_start)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The contiguous bytes of ``tensor`` as a flat uint8 view (no copy)."""
    if not tensor.is_contiguous():
        raise PlanError("byte_view needs a contiguous tensor")
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    return tensor.view(torch.uint8).reshape(-1)


def pack_entry(buffer: torch.Tensor, entry: BucketEntry, tensor: torch.Tensor) -> None:
    """Copy ``tensor`` (or the entry's chunk of it) into its place in ``buffer``."""
    spec = entry.spec
    if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.torch_dtype:
        raise PlanError(
            f"tensor {spec.name!r} is {tuple(tensor.shape)} {dtype_name(tensor.dtype)} but the "
            f"manifest says {spec.shape} {spec.dtype}; re-register the publisher when shapes change"
        )
    if entry.nbytes == 0:
        return
    dst = buffer[entry.offset : entry.offset + entry.nbytes]
    src = byte_view(tensor.contiguous())[entry.tensor_offset : entry.tensor_offset + entry.nbytes]
    dst.copy_(src, non_blocking=True)


def entry_view(buffer: torch.Tensor, entry: BucketEntry) -> torch.Tensor:
    """A zero-copy view of an unchunked entry as its tensor (dtype, shape) inside ``buffer``."""
    if entry.is_chunked:
        raise PlanError(f"{entry.name!r} is chunked; reassemble its chunks with ChunkAssembler")
    spec = entry.spec
    raw = buffer[entry.offset : entry.offset + entry.nbytes]
    return raw.view(spec.torch_dtype).reshape(spec.shape)


class ChunkAssembler:
    """Reassembles chunked tensors across buckets; yields each tensor once it is complete."""

    def __init__(self) -> None:
        self._partial: dict[str, tuple[torch.Tensor, set[int]]] = {}

    def add(self, buffer: torch.Tensor, entry: BucketEntry) -> torch.Tensor | None:
        spec = entry.spec
        if spec.name not in self._partial:
            full = torch.empty(spec.shape, dtype=spec.torch_dtype, device=buffer.device)
            self._partial[spec.name] = (full, set())
        full, seen = self._partial[spec.name]
        byte_view(full)[entry.tensor_offset : entry.tensor_offset + entry.nbytes].copy_(
            buffer[entry.offset : entry.offset + entry.nbytes]
        )
        seen.add(entry.chunk_index)
        if len(seen) < entry.num_chunks:
            return None
        del self._partial[spec.name]
        return full

    @property
    def pending(self) -> list[str]:
        return sorted(self._partial)


def unpack_bucket(
    buffer: torch.Tensor, bucket: Bucket, assembler: ChunkAssembler
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor that is complete after this bucket.

    Unchunked tensors are zero-copy views into ``buffer`` (valid until the buffer is reused);
    chunked tensors are yielded from the assembler once their last chunk arrived.
    """
    for entry in bucket.entries:
        if entry.is_chunked:
            full = assembler.add(buffer, entry)
            if full is not None:
                yield entry.name, full
        else:
            yield entry.name, entry_view(buffer, entry)
