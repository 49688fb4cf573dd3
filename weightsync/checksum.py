"""The per-bucket checksum: one integer reduction pass, cheap on CPU and GPU alike.

The bucket's bytes are viewed as int64 words in rows of 64 KiB (8192 words); a tail shorter
than a row is cut into rows of 256 bytes (the alignment, so every bucket length divides
evenly). Row sums are taken in one pass (wrapping 64-bit arithmetic, no upcast) and mixed
with their row positions. Wrapping addition is associative, so the value is identical on CPU
and CUDA whatever the reduction order. It catches flipped bits, stale, missing or shifted
data and words moved between rows; it does not see two words swapped inside one row, the
trade for reading every byte once at full bandwidth (on H200, sums over 256-byte rows ran at
under half the speed of a copy; over 64 KiB rows, at the speed of a full reduction). It is
not cryptographic.

The bucket checksum is taken from the staging buffer after packing, so it proves the transport
only. It is taken by the copies themselves where they can (the sender's pack, an in-place
receiver's reads), the same value without a second read of the bucket: on GPUs with CuPy in
the copy kernel (:mod:`.summed_copies`), on CPU block by block right behind the copies, while
the bytes are in cache (:mod:`.blocked_copies`). What a pack wrote is checked against its
source by :func:`verify_copies` / :func:`verify_entry` on CPU (shared memory) buffers, in the
same blocks right after their copies where the pack is blocked: a packing bug fails the
version naming the tensor, before any receiver reads that bucket. On CUDA buffers they compare
nothing: that would be a second read of every byte on the GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from weightsync.buckets import ALIGNMENT_BYTES, BucketEntry, byte_view
from weightsync.errors import ChecksumError
from weightsync.regions import _BITS  # the packer's integer dtype of each element size

ALGORITHM = "ws-rows64k-v3"
ROW_WORDS = 8192
_TAIL_ROW_WORDS = ALIGNMENT_BYTES // 8
_MASK64 = (1 << 64) - 1


def whole_row_words(nbytes: int) -> int:
    """How many of the first words of a bucket of ``nbytes`` are in 64 KiB rows (the rest are
    in 256-byte rows)."""
    return nbytes // 8 // ROW_WORDS * ROW_WORDS


def row_sums(buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The checksum's reduction of ``buffer[:nbytes]``, left on the buffer's device (no sync):
    queue it behind the copies that fill or read the buffer, finish it once per version."""
    if nbytes % ALIGNMENT_BYTES:
        raise ChecksumError(
            f"checksum needs a length that is a multiple of {ALIGNMENT_BYTES}, got {nbytes}"
        )
    if nbytes == 0:
        return torch.zeros(2, dtype=torch.int64, device=buffer.device)
    words = buffer[:nbytes].view(torch.int64)
    whole = whole_row_words(nbytes)
    sums = torch.cat(
        [
            words[:whole].view(-1, ROW_WORDS).sum(dim=1),
            words[whole:].view(-1, _TAIL_ROW_WORDS).sum(dim=1),
        ]
    )
    positions = torch.arange(1, sums.numel() + 1, device=buffer.device, dtype=torch.int64)
    return torch.stack([(sums * positions).sum(), sums.sum()])


def finish(sums: torch.Tensor, nbytes: int) -> int:
    """The checksum from :func:`row_sums` (moved to the CPU: waits for it)."""
    if nbytes == 0:
        return 0
    a, b = (int(x) & _MASK64 for x in sums.cpu().tolist())
    # Odd multipliers keep the two halves from cancelling each other.
    return (a * 0x9E3779B97F4A7C15 + b * 0xC2B2AE3D27D4EB4F + nbytes) & _MASK64


Sums = torch.Tensor | tuple[torch.Tensor, ...]
"""A bucket's :func:`row_sums`, or parts of them on several devices that add up to them
(:class:`~weightsync.summed_copies.LandedSums`: adding them on one GPU would make its stream wait
for the others')."""


def finish_all(sums: Sequence[Sums], sizes: Sequence[int]) -> list[int]:
    """:func:`finish` for many buckets at once, with one copy to the CPU per device; parts of
    one bucket's sums are added there (wrapping, as on the GPU)."""
    if not sums:
        return []
    parts = [s if isinstance(s, tuple) else (s,) for s in sums]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for bucket in parts:
        for part in bucket:
            by_device.setdefault(part.device, []).append(part)
    on_host = {device: iter(torch.stack(got).cpu()) for device, got in by_device.items()}
    values = []
    for bucket in parts:
        rows = [next(on_host[p.device]) for p in bucket]
        # Whole sums (nearly all) as they are: a sum per bucket costs thousands of buckets ms.
        values.append(rows[0] if len(rows) == 1 else torch.stack(rows).sum(dim=0))
    return [finish(v, n) for v, n in zip(values, sizes, strict=True)]


@torch.no_grad()
def verify_copies(
    what: str, name: str, copies: Iterable[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Check that each packed ``(destination, source)`` copy of tensor ``name`` holds its
    source's bits (a cast copy: the source cast the same way). CPU destinations only.

    Raises:
        ChecksumError: naming ``what`` (the version and bucket) and the tensor.
    """
    for dst, src in copies:
        if dst.is_cuda:
            return
        if src.dtype != dst.dtype or src.device != dst.device:
            src = src.to(dst.device, dst.dtype)
        if not torch.equal(*_as_bits(dst, src)):
            raise ChecksumError(
                f"{what}: tensor {name!r} was packed wrong: right after the copy, its "
                f"{dst.nbytes} bytes in the staging buffer are not its source's (a packing "
                "bug); the version fails and no receiver commits it"
            )


def _as_bits(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both as integers (NaN payloads compare equal): 64-bit words where both are contiguous
    and aligned (comparing costs about what the copy did; 16-bit elements took twice that),
    else integers of the element size."""
    if dst.is_contiguous() and src.is_contiguous() and dst.nbytes % 8 == 0:
        raw = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
        if all(t.data_ptr() % 8 == 0 for t in raw):
            return raw[0].view(torch.int64), raw[1].view(torch.int64)
    bits = _BITS.get(dst.element_size())
    return (dst.view(bits), src.view(bits)) if bits else (dst, src)


def verify_entry(what: str, buffer: torch.Tensor, entry: BucketEntry, tensor: torch.Tensor) -> None:
    """:func:`verify_copies` for an entry ``pack_entry`` packed from the whole ``tensor``."""
    if buffer.is_cuda or entry.nbytes == 0:
        return
    dst = buffer[entry.offset : entry.offset + entry.nbytes]
    src = byte_view(tensor.contiguous())[entry.tensor_offset : entry.tensor_offset + entry.nbytes]
    verify_copies(what, entry.name, [(dst, src)])
