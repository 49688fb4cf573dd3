"""Bounds on every field a peer sends, checked where its message enters, before anything is
allocated, mapped or recorded for it.

One place for the numbers (``docs/protocol.md`` §11 lists them) and the pure checks that
apply them to the control-plane messages. A message past a bound is refused with a
:class:`~weightsync.errors.ConfigError` (``INVALID_ARGUMENT``) naming the field; error text a
peer reports is kept but shortened (refusing an error report would lose the report).

Why these sizes: ``Status`` lists every receiver, publisher and the last ``history`` versions
with each receiver's outcome, so every string that ends up there (ids, names, error text) is
capped (an outcome is then at most about 3.5 KB), and the sender leaves its oldest versions out
of a reply over ``STATUS_REPLY_BUDGET_BYTES``, a quarter of the 256 MiB gRPC message limit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from weightsync.dtypes import dtype_from_name
from weightsync.errors import ConfigError, ProtocolError
from weightsync.v1 import weightsync_pb2 as pb

MAX_VERSION = 2**63 - 1
"""Versions are 1..2^63-1 (int64 in every language; -1 sent as uint64 is 2^64-1: refused)."""
MAX_NAME_BYTES = 1024
"""A tensor name (UTF-8); HF names are under 200."""
MAX_ID_BYTES = 256
"""publisher_id, receiver_id, engine, host_id, device, device_uuid, buffer_id, transport."""
MAX_PATH_BYTES = 4096
"""A shm path (Linux's PATH_MAX)."""
MAX_HANDLE_BYTES = 4096
"""Each opaque CUDA IPC handle (memory, ref counter, event): torch's are under 100."""
MAX_FOLDED_ACKS = 64
"""Acks one ``VersionApplied`` carries (``acks``): a receiver folds only the buckets it read
after the version's end had arrived, one or two."""
MAX_KEY_BYTES = 64
"""A key a peer picks (``begin_key``, ``keeps_key``; protocol §2.1): weightsync's are 16-24."""
MAX_ERROR_BYTES = 1024
"""Error text a peer reports (ErrorDetail.message, .code, .tensor): longer text is shortened."""
MAX_TENSORS = 1 << 18
"""Tensors in one manifest (a 671B MoE with one tensor per expert has about 50,000)."""
MAX_DIMS = 16
"""Dimensions of one tensor or piece."""
MAX_TENSOR_BYTES = 1 << 40
"""Bytes of one tensor (1 TiB): element count x itemsize, computed without overflow."""
MAX_BUCKET_ENTRIES = 1 << 20
"""Bucket entries a version may plan into (a tensor per bucket it spans, plus one each):
bounds the planner's work and memory whatever the bucket size."""
MAX_SOURCES = 1 << 12
"""Storages one rank offers (``BeginVersion.sources``)."""
MAX_PIECES = 1 << 20
"""Pieces one rank offers (``BeginVersion.pieces``)."""
MAX_READY_EVENTS = 1 << 12
"""Events one rank's offered pieces wait for (``BeginVersion.ready``)."""
MAX_WORLD_SIZE = 1 << 16
"""Publisher ranks of one version."""
MAX_TRANSPORTS = 16
"""Transports one receiver lists."""
MAX_LORA_CONFIG_BYTES = 1 << 16
"""A LoRA adapter's PEFT config JSON (PEFT writes about 1 KiB)."""
MAX_JSON_DEPTH = 32
"""Nesting of that JSON: checked before parsing, so deep input is an error, not a
RecursionError in a stream's thread."""
STATUS_REPLY_BUDGET_BYTES = 64 << 20
"""A Status reply over this drops its oldest versions (the gRPC limit is 256 MiB)."""


def quoted(text: str, keep: int = 64) -> str:
    """``text`` for an error message: repr'd, the first ``keep`` characters only."""
    return repr(text) if len(text) <= keep else f"{text[:keep]!r}... ({len(text)} characters)"


def check_text(text: str, field: str, limit: int) -> None:
    # len() first: a character is at most 4 bytes, so most text needs no encoding.
    if len(text) * 4 > limit and len(text.encode()) > limit:
        raise ConfigError(
            f"{field} is {len(text.encode())} bytes, over the limit of {limit}: {quoted(text)}"
        )


def check_key(key: bytes, field: str) -> None:
    if len(key) > MAX_KEY_BYTES:
        raise ConfigError(f"{field} is {len(key)} bytes, over the limit of {MAX_KEY_BYTES}")


def check_count(items: Sequence, field: str, limit: int) -> None:
    if len(items) > limit:
        raise ConfigError(f"{field} has {len(items)} entries, over the limit of {limit}")


def check_dims(dims: Sequence[int], field: str) -> None:
    if len(dims) > MAX_DIMS:
        raise ConfigError(f"{field} has {len(dims)} dimensions, over the limit of {MAX_DIMS}")
    if dims and min(dims) < 0:
        raise ConfigError(f"{field} {list(dims)} has a negative entry")


def check_tensor(spec: pb.TensorSpec, field: str) -> None:
    """Bound one tensor spec: name, dimensions, and bytes (exact integers: the product
    cannot overflow, and a huge one is refused before anything is sized by it)."""
    check_text(spec.name, f"{field}.name", MAX_NAME_BYTES)
    shape = spec.shape
    check_dims(shape, f"{field}.shape of {quoted(spec.name)}")
    nbytes = math.prod(shape) * dtype_from_name(spec.dtype).itemsize
    if nbytes > MAX_TENSOR_BYTES:
        raise ConfigError(
            f"{field} {quoted(spec.name)} of shape {list(shape)} {spec.dtype} is {nbytes} "
            f"bytes, over the limit of {MAX_TENSOR_BYTES}"
        )


def check_manifest(manifest: pb.Manifest, field: str = "Manifest") -> None:
    """Bound a wire manifest's tensors and LoRA adapter (its version: ``VersionManifest``).
    Both sides run it once per tensor list (``wire.manifest_from_pb``, cached)."""
    check_count(manifest.tensors, f"{field}.tensors", MAX_TENSORS)
    for i, spec in enumerate(manifest.tensors):
        check_tensor(spec, f"{field}.tensors[{i}]")
    if manifest.HasField("lora"):
        check_lora(manifest.lora, f"{field}.lora")
    if manifest.HasField("part"):
        check_text(manifest.part.sender_id, f"{field}.part.sender_id", MAX_NAME_BYTES)
        check_text(manifest.part.plan_digest, f"{field}.part.plan_digest", MAX_NAME_BYTES)


def check_entries(num_tensors: int, total_bytes: int, bucket_size_bytes: int) -> None:
    """Bound the bucket entries a manifest plans into (at most twice this estimate: a chunk
    is at least half a bucket), before the planner lists them."""
    entries = num_tensors + total_bytes // bucket_size_bytes
    if entries > MAX_BUCKET_ENTRIES:
        raise ConfigError(
            f"BeginVersion.manifest would plan into about {entries} bucket entries at "
            f"{bucket_size_bytes}-byte buckets, over the limit of {MAX_BUCKET_ENTRIES}; publish "
            "fewer or smaller tensors, or run the sender with a larger bucket_size_bytes"
        )


def check_lora(lora: pb.LoraAdapter, field: str) -> None:
    check_text(lora.name, f"{field}.name", MAX_NAME_BYTES)
    check_count(lora.tensor_names, f"{field}.tensor_names", MAX_TENSORS)
    for i, name in enumerate(lora.tensor_names):
        check_text(name, f"{field}.tensor_names[{i}]", MAX_NAME_BYTES)
    check_json(lora.config_json, f"{field}.config_json")


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def check_json(text: str, field: str) -> None:
    """Bound a JSON document's size and nesting without parsing it (brackets inside strings
    do not count)."""
    check_text(text, field, MAX_LORA_CONFIG_BYTES)
    depth = deepest = 0
    for ch in _JSON_STRING.sub("", text):
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    if deepest > MAX_JSON_DEPTH:
        raise ConfigError(f"{field} nests {deepest} deep, over the limit of {MAX_JSON_DEPTH}")


def check_publisher_hello(hello: pb.PublisherHello) -> None:
    for name in ("publisher_id", "device", "device_uuid"):
        check_text(getattr(hello, name), f"PublisherHello.{name}", MAX_ID_BYTES)
    if hello.world_size > MAX_WORLD_SIZE:
        raise ConfigError(
            f"PublisherHello.world_size {hello.world_size} is over the limit of {MAX_WORLD_SIZE}"
        )


def check_receiver_hello(hello: pb.ReceiverHello) -> None:
    for name in ("receiver_id", "engine", "device", "device_uuid", "host_id"):
        check_text(getattr(hello, name), f"ReceiverHello.{name}", MAX_ID_BYTES)
    check_count(hello.transports, "ReceiverHello.transports", MAX_TRANSPORTS)
    for i, transport in enumerate(hello.transports):
        check_text(transport, f"ReceiverHello.transports[{i}]", MAX_ID_BYTES)


def check_offer(offer: pb.BeginVersion | pb.WriteOffer) -> None:
    """Bound what a ``BeginVersion`` (a publisher's tensors) or a ``WriteOffer`` (a receiver's
    weights) offers: its storages and pieces (run once per offer, before mapping or planning
    from it)."""
    message = offer.DESCRIPTOR.name
    check_count(offer.sources, f"{message}.sources", MAX_SOURCES)
    for i, handle in enumerate(offer.sources):
        check_buffer_handle(handle, f"{message}.sources[{i}]")
    ready = getattr(offer, "ready", ())  # a WriteOffer's pieces wait for nothing
    check_count(ready, f"{message}.ready", MAX_READY_EVENTS)
    for i, handle in enumerate(ready):
        if len(handle) > MAX_HANDLE_BYTES:
            raise ConfigError(
                f"{message}.ready[{i}] is {len(handle)} bytes, over the limit of {MAX_HANDLE_BYTES}"
            )
    check_count(offer.pieces, f"{message}.pieces", MAX_PIECES)
    for i, piece in enumerate(offer.pieces):
        check_piece(piece, i, len(offer.sources), message, len(ready))


def check_buffer_handle(handle: pb.BufferHandle, field: str) -> None:
    check_text(handle.buffer_id, f"{field}.buffer_id", MAX_ID_BYTES)
    if handle.HasField("shm"):
        check_text(handle.shm.path, f"{field}.shm.path", MAX_PATH_BYTES)
    elif handle.HasField("cuda_ipc"):
        ipc = handle.cuda_ipc
        check_text(ipc.device_uuid, f"{field}.cuda_ipc.device_uuid", MAX_ID_BYTES)
        for name in ("memory_handle", "ref_counter_handle", "event_handle"):
            size = len(getattr(ipc, name))
            if size > MAX_HANDLE_BYTES:
                raise ConfigError(
                    f"{field}.cuda_ipc.{name} is {size} bytes, over the limit of {MAX_HANDLE_BYTES}"
                )


def check_piece(
    piece: pb.SourcePiece,
    i: int,
    num_sources: int,
    message: str = "BeginVersion",
    num_ready: int = 0,
) -> None:
    """Bound ``<message>.pieces[i]``: its name, dtype, source, ready event, and a box whose
    ``size``, ``stride`` and ``dst_start`` agree in rank, are non-negative, and span at most
    :data:`MAX_TENSOR_BYTES` of its storage."""
    size, stride, start = piece.size, piece.stride, piece.dst_start
    itemsize = dtype_from_name(piece.dtype).itemsize
    rank = len(size)
    # One pass over what every piece has; the field is named only for a refused one.
    if (
        len(piece.name) * 4 <= MAX_NAME_BYTES
        and piece.source < num_sources
        and piece.ready <= num_ready
        and rank == len(stride) == len(start) <= MAX_DIMS
        and (not rank or min(min(size), min(stride), min(start)) >= 0)
    ):
        span = 0 if 0 in size else 1 + sum(map(_reach, size, stride))
        if max(span, math.prod(size)) * itemsize <= MAX_TENSOR_BYTES:
            return
    field = f"{message}.pieces[{i}]"
    check_text(piece.name, f"{field}.name", MAX_NAME_BYTES)
    what = f"{field} (of {quoted(piece.name)})"
    if piece.source >= num_sources:
        raise ConfigError(
            f"{what}.source {piece.source} names no storage: {message}.sources has {num_sources}"
        )
    if piece.ready > num_ready:
        raise ConfigError(
            f"{what}.ready {piece.ready} names no event: {message}.ready has {num_ready} "
            "(0: the piece is written already)"
        )
    if not rank == len(stride) == len(start):
        raise ConfigError(
            f"{what}: size {list(size)}, stride {list(stride)} and dst_start {list(start)} "
            "must have one entry per dimension each"
        )
    for name, dims in (("size", size), ("stride", stride), ("dst_start", start)):
        check_dims(dims, f"{what}.{name}")
    raise ConfigError(
        f"{what}: size {list(size)} with stride {list(stride)} spans over {MAX_TENSOR_BYTES} bytes"
    )


def _reach(n: int, stride: int) -> int:
    return (n - 1) * stride


def _kind_after_hello(msg, stream: str, kinds: str, to_hello: str) -> str:
    """The kind set on ``msg`` (a message after its ``stream`` stream's hello).

    Raises:
        ConfigError: no kind is set.
        ProtocolError: a second hello.
    """
    message = type(msg).__name__
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ConfigError(f"{message} has no kind set; after hello send {kinds}")
    if kind == "hello":
        raise ProtocolError(
            f"{message}.hello: a second hello on one {stream} stream; open a new stream "
            f"to {to_hello}"
        )
    return kind


def check_publisher_message(msg: pb.PublisherMessage) -> str:
    """The kind of a message after a Publish stream's hello (its error text shortened).

    Raises:
        ConfigError: no kind is set, or a field is past its bound.
        ProtocolError: a second hello.
    """
    kind = _kind_after_hello(msg, "Publish", "begin, packed or error", "say hello again")
    if kind == "begin":
        check_key(msg.begin.begin_key, "BeginVersion.begin_key")
    if kind == "error":
        msg.error.CopyFrom(shortened(msg.error))
    return kind


def check_receiver_message(msg: pb.ReceiverMessage) -> str:
    """The kind of a message after a Receive stream's hello (its error text shortened).

    Raises:
        ConfigError: no kind is set, or a field is past its bound.
        ProtocolError: a second hello.
    """
    kind = _kind_after_hello(
        msg, "Receive", "verdict, ack, applied, exported or offer", "register again"
    )
    body = getattr(msg, kind)
    if kind == "verdict":
        check_key(body.keeps_key, "ManifestVerdict.keeps_key")
        check_key(body.writes_key, "ManifestVerdict.writes_key")
    if kind == "offer":
        check_key(body.key, "WriteOffer.key")
        return kind  # its sources and pieces are checked where it is mapped
    if kind == "ack":
        _check_read_event(body, "BucketAck.read_event")
    if kind == "applied":
        _check_folded_acks(body)
    if body.HasField("error"):
        body.error.CopyFrom(shortened(body.error))
    return kind


def _check_read_event(ack: pb.BucketAck, field: str) -> None:
    if len(ack.read_event) > MAX_HANDLE_BYTES:
        raise ConfigError(
            f"{field} is {len(ack.read_event)} bytes, over the limit of {MAX_HANDLE_BYTES}"
        )


def _check_folded_acks(applied: pb.VersionApplied) -> None:
    """``VersionApplied.acks``: each of the applied version, and only with a commit (a failed
    version's acks, and a failed bucket's, go alone, before it)."""
    if len(applied.acks) > MAX_FOLDED_ACKS:
        raise ConfigError(
            f"VersionApplied.acks has {len(applied.acks)} entries, over the limit of "
            f"{MAX_FOLDED_ACKS}"
        )
    for i, ack in enumerate(applied.acks):
        _check_read_event(ack, f"VersionApplied.acks[{i}].read_event")
        if not (applied.ok and ack.ok) or ack.version != applied.version:
            raise ProtocolError(
                f"VersionApplied.acks[{i}] (bucket {ack.index} of version {ack.version}, ok "
                f"{ack.ok}) came with applied ok {applied.ok} for version {applied.version}; "
                "send with a commit only its own version's acks of buckets read whole, and "
                "any other ack alone, before it"
            )


def shortened(detail: pb.ErrorDetail) -> pb.ErrorDetail:
    """``detail`` with each text field cut to :data:`MAX_ERROR_BYTES` (as reported by a peer:
    kept for Status and logs, never refused)."""
    fields = {name: getattr(detail, name) for name in ("code", "message", "tensor")}
    if all(len(text) <= MAX_ERROR_BYTES // 4 for text in fields.values()):
        return detail  # fast path: under the limit even at 4 bytes per character
    return pb.ErrorDetail(**{name: _cut(text) for name, text in fields.items()})


def _cut(text: str) -> str:
    data = text.encode()
    if len(data) <= MAX_ERROR_BYTES:
        return text
    head = data[: MAX_ERROR_BYTES - 40].decode("utf-8", "ignore")
    return f"{head}... ({len(data)} bytes, shortened)"
