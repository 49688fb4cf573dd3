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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from weightsync.buckets import ALIGNMENT_BYTES
from weightsync.checksum import finish, row_sums
from weightsync.errors import ChecksumError, ConfigError, WrongBaseError

Kind = Literal["indices", "xor", "full"]
GAP_WORDS = 2
"""Zero words kept inside an XOR run rather than starting a new one (a run costs 8 bytes)."""
_UNITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
"""The integer dtype of each element size the ``indices`` form compares and carries."""


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


def checksum_of(data: torch.Tensor) -> int:
    """The bucket checksum of ``data``'s bytes."""
    flat = _bytes(data)
    return finish(row_sums(flat, flat.numel()), flat.numel())


@torch.no_grad()
def sizes(previous: torch.Tensor, new: torch.Tensor, element_bytes: int | None = None) -> Sizes:
    """The cost of each form of the delta from ``previous`` to ``new`` (one pass over each).

    Raises:
        ConfigError: sizes that differ, a length not a multiple of 256 (buckets are), an
            element size other than 1, 2 or 4.
    """
    return _measured(*_checked(previous, new, element_bytes, "a delta"))[0]


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
    cost, changed, starts, lengths = _measured(old, cur, unit)
    if cost.kind == "indices":
        where = torch.nonzero(changed).flatten()
        parts: tuple[torch.Tensor, ...] = (where.to(torch.int32), cur.view(_UNITS[unit])[where])
    elif cost.kind == "xor":
        words = old.view(torch.int32) ^ cur.view(torch.int32)
        parts = (starts, lengths, words[_covered(starts, lengths, words.numel())])
    else:
        parts = (cur.clone(),)
    return Delta(
        bucket,
        cost.kind,
        base_version,
        checksum_of(old),
        checksum_of(cur),
        cur.numel(),
        unit,
        parts,
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
        out.view(_UNITS[delta.element_bytes])[indices.long()] = values
    elif delta.kind == "xor":
        starts, lengths, words = delta.parts
        target = out.view(torch.int32)
        covered = _covered(starts, lengths, target.numel())
        target[covered] = target[covered] ^ words
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
    if cur.numel() % ALIGNMENT_BYTES or unit not in _UNITS:
        raise ConfigError(
            f"{bucket}: deltas take buckets of a multiple of {ALIGNMENT_BYTES} bytes in "
            f"elements of 1, 2 or 4 bytes, not {cur.numel()} bytes of {unit}"
        )
    if cur.numel() // unit >= 2**31:
        raise ConfigError(f"{bucket}: {cur.numel() // unit} elements exceed int32 indices")
    return old, cur, unit


def _measured(
    old: torch.Tensor, cur: torch.Tensor, unit: int
) -> tuple[Sizes, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sizes, the mask of changed elements and the XOR form's runs."""
    changed = old.view(_UNITS[unit]) != cur.view(_UNITS[unit])
    count = int(torch.count_nonzero(changed))  # a sum of bools widens to int64: 7x slower
    starts, lengths = _run_bounds(old.view(torch.int32) != cur.view(torch.int32))
    xor = starts.numel() * 8 + int(lengths.sum()) * 4
    return Sizes(count * (4 + unit), xor, old.numel(), count), changed, starts, lengths


def _run_bounds(nonzero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int32 starts and lengths of the runs covering ``nonzero``'s words, a run going on
    across gaps of up to :data:`GAP_WORDS` zero words."""
    at = torch.nonzero(nonzero).flatten()
    if not at.numel():
        empty = torch.zeros(0, dtype=torch.int32, device=nonzero.device)
        return empty, empty
    new_run = (at[1:] - at[:-1]) > GAP_WORDS + 1
    first = torch.cat([at[:1], at[1:][new_run]])
    last = torch.cat([at[:-1][new_run], at[-1:]])
    return first.to(torch.int32), (last - first + 1).to(torch.int32)


def _covered(starts: torch.Tensor, lengths: torch.Tensor, words: int) -> torch.Tensor:
    """The words the runs cover, as a mask."""
    marks = torch.zeros(words + 1, dtype=torch.int32, device=starts.device)
    marks.index_add_(0, starts.long(), torch.ones_like(starts))
    marks.index_add_(0, (starts + lengths).long(), -torch.ones_like(starts))
    return marks.cumsum(0)[:-1] > 0
