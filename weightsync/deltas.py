"""Exact deltas between versions of one bucket (issue 36): pure tensor code, CPU or CUDA, no I/O.

With RL's small learning rates most bf16 values of a bucket are bit-identical from one version
to the next, so a bucket can travel as its difference from the version the receiver holds, in
the smallest of three forms, chosen per bucket:

- ``indices``: the changed elements' flat indices (int32) and their new values (the bucket's
  element size: 2 bytes for bf16). ``4 + element`` bytes per changed element: best for
  scattered changes.
- ``xor``: the XOR of the 32-bit words, as runs of nonzero words (int32 start and length per
  run, then the runs' words; zero gaps of up to :data:`GAP_WORDS` words are kept inside a run,
  cheaper than a new run's 8 bytes). Best where changes cluster (a float32 norm that changes
  whole, a tensor that changes everywhere beside ones that barely do).
- ``full``: the new bytes, when neither form is smaller than they are.

Comparisons are of bits (integer views), so NaN payloads, signed zeros and any dtype travel
exactly. A delta carries the version it was made from, the checksum of those bytes and of the
result (:mod:`weightsync.checksum`'s algorithm): :func:`decode` refuses other bytes
(:class:`~weightsync.errors.WrongBaseError`, naming the bucket; the receiver then needs full
bytes) before writing anything, and checks the result it wrote.

Both ends run in a few whole-tensor torch ops on the bucket's device (:mod:`weightsync.
delta_scan`): on CUDA one sync to size the payload when encoding and one to check the result
when decoding; on CPU two passes over the bucket beside the checksums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from weightsync import delta_scan
from weightsync.buckets import ALIGNMENT_BYTES
from weightsync.delta_scan import GAP_WORDS, UNITS, Scan, checksum_of, covered_words
from weightsync.errors import ChecksumError, ConfigError, WrongBaseError

__all__ = ["GAP_WORDS", "UNITS", "Delta", "Sizes", "checksum_of", "decode", "encode", "sizes"]

Kind = Literal["indices", "xor", "full"]


@dataclass(frozen=True)
class Delta:
    """One bucket's new bytes as a difference from its bytes at ``base_version``."""

    bucket: str
    """Which bucket (for messages), e.g. ``"version 7, bucket 3"``."""
    kind: Kind
    base_version: int
    base_checksum: int
    """The checksum of the bytes it was made from."""
    checksum: int
    """The checksum of the bytes it decodes to."""
    nbytes: int
    element_bytes: int
    parts: tuple[torch.Tensor, ...]
    """``indices``: (int32 indices, values); ``xor``: (int32 starts, int32 lengths, int32
    words); ``full``: (the new bytes,)."""

    @property
    def payload_bytes(self) -> int:
        """The bytes that travel (beside a fixed header of the fields above)."""
        return sum(p.nbytes for p in self.parts)


@dataclass(frozen=True)
class Sizes:
    """What each form of one bucket's delta would cost, in bytes, and which is chosen."""

    indices: int
    xor: int
    full: int
    changed: int
    """Elements that differ."""

    @property
    def kind(self) -> Kind:
        """The smallest form; ``full`` unless a delta is smaller than the bytes (ties: the
        index form, which decodes with one scatter)."""
        best = min(("indices", self.indices), ("xor", self.xor), key=lambda kv: kv[1])
        return best[0] if best[1] < self.full else "full"  # type: ignore[return-value]


@torch.no_grad()
def sizes(previous: torch.Tensor, new: torch.Tensor, element_bytes: int | None = None) -> Sizes:
    """The cost of each form of the delta from ``previous`` to ``new``.

    Raises:
        ConfigError: sizes that differ, a length not a multiple of 256 (buckets are), an
            element size other than 1, 2 or 4.
    """
    old, cur, unit = _checked(previous, new, element_bytes, "a delta")
    return _sizes(_scan(old, cur, unit), cur.numel(), unit)


@torch.no_grad()
def encode(
    previous: torch.Tensor,
    new: torch.Tensor,
    *,
    base_version: int,
    bucket: str,
    element_bytes: int | None = None,
) -> Delta:
    """``new`` as a :class:`Delta` from ``previous`` (the bytes of ``bucket`` at
    ``base_version``), in its smallest form. Neither input is changed; the parts are new
    tensors on their device. ``element_bytes``: the unit the ``indices`` form compares
    (default ``new``'s element size; 2 for bf16 buckets passed as bytes).

    Raises:
        ConfigError: as :func:`sizes` does, naming ``bucket``.
    """
    old, cur, unit = _checked(previous, new, element_bytes, bucket)
    scan = _scan(old, cur, unit)
    kind = _sizes(scan, cur.numel(), unit).kind
    if kind == "indices":
        parts: tuple[torch.Tensor, ...] = scan.indices()
    elif kind == "xor":
        parts = scan.xor()
    else:
        parts = (cur.clone(),)
    return Delta(
        bucket, kind, base_version, scan.base_checksum, scan.checksum, cur.numel(), unit, parts
    )


@torch.no_grad()
def decode(
    delta: Delta, previous: torch.Tensor, *, base_version: int, base_checksum: int | None = None
) -> torch.Tensor:
    """Apply ``delta`` onto ``previous`` in place (the receiver's bytes of the bucket, held at
    ``base_version``) and return it. A ``full`` delta applies onto any bytes. Pass
    ``base_checksum`` when the receiver knows it (it checked the bucket when it arrived);
    else it is taken here.

    Raises:
        WrongBaseError: ``previous`` is not the version, or not the bytes, the delta was made
            from; nothing was written.
        ChecksumError: the result is not the bytes the delta was made to (a corrupt delta).
        ConfigError: ``previous`` is not the delta's size.
    """
    out = _bytes(previous)
    if out.numel() != delta.nbytes:
        raise ConfigError(
            f"{delta.bucket}: a delta of {delta.nbytes} bytes cannot apply onto {out.numel()}"
        )
    if delta.kind != "full":
        _check_base(delta, out, base_version, base_checksum)
    if delta.kind == "indices":
        indices, values = delta.parts
        out.view(UNITS[delta.element_bytes]).index_put_((indices,), values)
    elif delta.kind == "xor":
        starts, lengths, words = delta.parts
        target = out.view(torch.int32)
        at = covered_words(starts, lengths, words.numel())
        target.index_put_((at,), target.index_select(0, at) ^ words)
    else:
        out.copy_(delta.parts[0])
    got = checksum_of(out)
    if got != delta.checksum:
        raise ChecksumError(
            f"{delta.bucket}: after applying its {delta.kind} delta from version "
            f"{delta.base_version} the bytes checksum {got:#x}, not {delta.checksum:#x}: the "
            "delta is corrupt; fetch the bucket's full bytes"
        )
    return previous


def _check_base(delta: Delta, out: torch.Tensor, version: int, known: int | None) -> None:
    if version != delta.base_version:
        raise WrongBaseError(
            f"{delta.bucket}: the delta was made from version {delta.base_version}, but this "
            f"receiver holds version {version}; it needs the bucket's full bytes"
        )
    held = checksum_of(out) if known is None else known
    if held != delta.base_checksum:
        raise WrongBaseError(
            f"{delta.bucket}: the bytes held as version {version} checksum {held:#x}, not "
            f"{delta.base_checksum:#x} as the delta's base did; it needs the bucket's full bytes"
        )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 view (it must be contiguous)."""
    return t.reshape(-1).view(torch.uint8)


def _scan(old: torch.Tensor, cur: torch.Tensor, unit: int) -> Scan:
    """The scan suited to the device: on a GPU whole-bucket masks cost little beside a host
    round trip; on a CPU each pass over the bucket costs."""
    return (delta_scan.dense if cur.is_cuda else delta_scan.sparse)(old, cur, unit)


def _sizes(scan: Scan, nbytes: int, unit: int) -> Sizes:
    return Sizes(scan.changed * (4 + unit), scan.runs * 8 + scan.covered * 4, nbytes, scan.changed)


def _checked(
    previous: torch.Tensor, new: torch.Tensor, element_bytes: int | None, bucket: str
) -> tuple[torch.Tensor, torch.Tensor, int]:
    unit = element_bytes or new.element_size()
    old, cur = _bytes(previous), _bytes(new)
    if old.numel() != cur.numel() or old.device != cur.device:
        raise ConfigError(
            f"{bucket}: a delta needs two versions of one bucket, got {old.numel()} bytes on "
            f"{old.device} and {cur.numel()} on {cur.device}"
        )
    if cur.numel() % ALIGNMENT_BYTES or unit not in UNITS:
        raise ConfigError(
            f"{bucket}: deltas take buckets of a multiple of {ALIGNMENT_BYTES} bytes in "
            f"elements of 1, 2 or 4 bytes, not {cur.numel()} bytes of {unit}"
        )
    if cur.numel() // unit >= 2**31:
        raise ConfigError(f"{bucket}: {cur.numel() // unit} elements exceed int32 indices")
    if old.storage_offset() % 8 or cur.storage_offset() % 8:
        raise ConfigError(
            f"{bucket}: deltas compare 64-bit words: the bytes must start 8-byte aligned, not "
            f"at offsets {old.storage_offset()} and {cur.storage_offset()}"
        )
    return old, cur, unit
