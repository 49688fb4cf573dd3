"""A delta's wire form (protocol §5.1): one broadcast payload and its ``pb.BucketDelta``.

:mod:`weightsync.deltas` makes and applies deltas as tensors; this lays their parts end to end
in one byte buffer, the one tensor a broadcast carries, and reads them back, checking that the
announcement and the payload agree before :func:`~weightsync.deltas.decode` touches anything.
Pure: no I/O.
"""

from __future__ import annotations

import torch

from weightsync.deltas import UNITS, Delta
from weightsync.errors import ProtocolError
from weightsync.v1 import weightsync_pb2 as pb


def element_bytes(bucket_dtypes: dict[int, int]) -> int:
    """The element size a bucket's ``indices`` form compares: that of most of its bytes
    (``bucket_dtypes``: bytes by element size). Sizes above 4 compare 4-byte words."""
    unit = max(bucket_dtypes.items(), key=lambda kv: kv[1], default=(2, 0))[0]
    return min(unit, 4)


def to_wire(delta: Delta) -> tuple[pb.BucketDelta, torch.Tensor]:
    """The announcement's delta fields and the payload to broadcast (its parts in order)."""
    payload = _end_to_end([p.reshape(-1).view(torch.uint8) for p in delta.parts])
    count = delta.parts[0].numel()
    return (
        pb.BucketDelta(
            form=delta.kind,
            base_version=delta.base_version,
            base_checksum=delta.base_checksum,
            checksum=delta.checksum,
            nbytes=payload.numel(),
            count=count,
            element_bytes=delta.element_bytes,
        ),
        payload,
    )


def from_wire(msg: pb.BucketDelta, payload: torch.Tensor, nbytes: int, bucket: str) -> Delta:
    """The :class:`Delta` of ``bucket`` (``nbytes`` bytes) that ``msg`` announced and
    ``payload`` carried (views of it, no copies).

    Raises:
        ProtocolError: a form this receiver does not know, or sizes, runs or indices that do
            not fit the bucket; nothing was written.
    """
    count, size = msg.count, payload.numel()
    if msg.form == "indices" and msg.element_bytes in UNITS:
        unit = msg.element_bytes
        expect = count * (4 + unit)
    elif msg.form == "xor":
        unit = msg.element_bytes or 4
        expect = None  # the words follow the runs: checked against their lengths below
    else:
        raise _bad(bucket, f"form {msg.form!r} with elements of {msg.element_bytes} bytes")
    if size != msg.nbytes or nbytes % 4 or (expect is not None and size != expect):
        raise _bad(bucket, f"{size} payload bytes for {count} item(s), announced {msg.nbytes}")
    head = payload[: count * 4].view(torch.int32)
    if msg.form == "indices":
        values = payload[count * 4 :].view(UNITS[unit])
        low, high = _host(head.min(), head.max()) if count else (0, 0)
        if low < 0 or high >= nbytes // unit:
            raise _bad(bucket, "an element index outside the bucket")
        parts: tuple[torch.Tensor, ...] = (head, values)
    else:
        if size < count * 8:
            raise _bad(bucket, f"{size} payload bytes cannot hold {count} run(s)")
        lengths = payload[count * 4 : count * 8].view(torch.int32)
        words = payload[count * 8 :].view(torch.int32)
        if count:
            ends = head.long() + lengths.long()
            total, low, shortest, end = _host(lengths.sum(), head.min(), lengths.min(), ends.max())
        if count and (total != words.numel() or low < 0 or shortest < 1 or end > nbytes // 4):
            raise _bad(bucket, "XOR runs that do not fit the bucket or its words")
        if not count and words.numel():
            raise _bad(bucket, "XOR words without runs")
        parts = (head, lengths, words)
    return Delta(
        bucket,
        msg.form,  # type: ignore[arg-type]
        msg.base_version,
        msg.base_checksum,
        msg.checksum,
        nbytes,
        unit,
        parts,
    )


def _host(*values: torch.Tensor) -> list[int]:
    """Scalars of the payload on the host, in one copy (one sync on CUDA)."""
    return torch.stack([v.long() for v in values]).tolist()


def _bad(bucket: str, what: str) -> ProtocolError:
    return ProtocolError(
        f"{bucket}: its delta announcement and payload disagree ({what}); the sender and "
        "this receiver speak different delta forms (protocol §5.1)"
    )


def _end_to_end(parts: list[torch.Tensor]) -> torch.Tensor:
    """The byte views ``parts`` as one tensor: a view where each starts where the one before
    ends in one allocation (the CUDA encoder lays them so), else a copy."""
    first = parts[0]
    at = first.data_ptr()
    for p in parts:
        if p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or (
            p.numel() and p.data_ptr() != at
        ):
            return torch.cat(parts)
        at += p.numel()
    return first.as_strided((at - first.data_ptr(),), (1,))
