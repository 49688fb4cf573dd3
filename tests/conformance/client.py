"""A weightsync control-plane client written from docs/protocol.md and the .proto alone.

It runs in its own process with only grpcio, protobuf and stubs generated from
``proto/weightsync/v1/weightsync.proto`` at test time (``weightsync_pb2``): importing
``weightsync`` (or torch) here fails on purpose, so nothing of the implementation leaks in.

Commands (each prints JSON lines on stdout):

- ``checksum``: the bucket checksum of the bytes written in hex on stdin (docs/protocol.md).
- ``status``: the sender's ``Status`` reply.
- ``wait-applied V``: ``WaitApplied(V)``.
- ``receive``: register, then apply ``--versions`` versions from shm staging buffers,
  verifying every bucket's checksum, keeping manifests by key (§2.1); prints one ``applied``
  line per version with each tensor's bytes; leaves in order (half-close, read each stream to
  its end) when stdin closes, or at once with ``--leave``, and prints the status each sender
  ended its stream with. ``--address`` given once per sender registers with several: a
  version split over them (``Manifest.part``, §4.1) is joined from its parts.
- ``publish``: publish ``--versions`` versions from ``--version`` on of ``--tensors`` (JSON:
  name, dtype, shape) on one stream, with bytes made from ``--seed`` (plus the version's
  index), the begin sent once with its contents and then by its key alone (§2.1); one
  ``published`` line per version. ``--mode offer`` places them in a shared-memory buffer of
  its own and offers it (the sender packs, or asks for ``pack`` where it cannot), ``--mode
  pack`` packs each bucket into the sender's staging buffer when asked. ``--lane`` moves the
  stream to a lane (§1.1) and passes the offered buffer's descriptor with the begin (§6.1);
  without it the offer is a path alone, which the sender does not map. ``--plan`` (every
  part's tensors) with ``--part I --sender-id S`` publishes part ``I`` of a split version
  instead.
- ``errors``: provoke the protocol's error statuses and report the codes and details.
"""

from __future__ import annotations

import importlib.abc
import sys


class _Forbidden(importlib.abc.MetaPathFinder):
    """Fails any import of the implementation: this client knows only the .proto."""

    BLOCKED = ("weightsync", "torch")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.BLOCKED:
            raise ImportError(f"the conformance client must not import {name!r}")
        return None


sys.meta_path.insert(0, _Forbidden())

import argparse  # noqa: E402
import array  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import mmap  # noqa: E402
import os  # noqa: E402
import queue  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402
import threading  # noqa: E402
import uuid  # noqa: E402

import grpc  # noqa: E402
import weightsync_pb2 as pb  # noqa: E402
import weightsync_pb2_grpc as pb_grpc  # noqa: E402
from google.protobuf import json_format  # noqa: E402

# ---- the spec's constants --------------------------------------------------------------------

ALIGNMENT = 256
CHECKSUM_ALGORITHM = "ws-rows64k-v3"
ROW_WORDS = 8192  # 64 KiB rows
TAIL_ROW_WORDS = ALIGNMENT // 8  # 256-byte rows for the tail
K_POSITIONAL = 0x9E3779B97F4A7C15
K_PLAIN = 0xC2B2AE3D27D4EB4F
MASK = (1 << 64) - 1
ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2,
    "bfloat16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip
KEYS_KEPT = 16  # of each kind per stream (§2.1)


def checksum(data, nbytes: int) -> int:
    """ws-rows64k-v3 of ``data[:nbytes]`` (docs/protocol.md), from its description."""
    if nbytes % ALIGNMENT:
        raise ValueError(f"checksum length {nbytes} is not a multiple of {ALIGNMENT}")
    if nbytes == 0:
        return 0
    words = struct.unpack_from(f"<{nbytes // 8}Q", data, 0)
    whole = len(words) // ROW_WORDS * ROW_WORDS
    rows = [sum(words[i : i + ROW_WORDS]) for i in range(0, whole, ROW_WORDS)]
    rows += [sum(words[i : i + TAIL_ROW_WORDS]) for i in range(whole, len(words), TAIL_ROW_WORDS)]
    rows = [r & MASK for r in rows]
    positional = sum(r * (i + 1) for i, r in enumerate(rows)) & MASK
    plain = sum(rows) & MASK
    return (positional * K_POSITIONAL + plain * K_PLAIN + nbytes) & MASK


class KeptByKey:
    """The keeping side of one kind on one stream (§2.1 rule 4): contents received under a new
    key while 16 are kept forget them all first."""

    def __init__(self) -> None:
        self.known: dict[bytes, object] = {}

    def keep(self, key: bytes, value) -> None:
        if key not in self.known and len(self.known) >= KEYS_KEPT:
            self.known.clear()
        self.known[key] = value


class SentKeys:
    """The sending side of one kind on one stream (§2.1 rules 3, 4)."""

    def __init__(self) -> None:
        self.sent: set[bytes] = set()
        self.peer_keeps = False  # its welcome said `<kind>_keys`

    def alone(self, key: bytes) -> bool:
        """The key may go alone; else the contents go with it, held from now on."""
        if key in self.sent:
            return self.peer_keeps
        if len(self.sent) >= KEYS_KEPT:
            self.sent.clear()
        self.sent.add(key)
        return False


def nbytes_of(spec) -> int:
    return math.prod(spec["shape"]) * ITEMSIZE[spec["dtype"]]


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def to_dict(msg) -> dict:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


class _Token(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """``authorization: Bearer <token>`` on every call (docs/protocol.md, "Authentication")."""

    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    def _add(self, continuation, details, request):
        # grpc's call details are a namedtuple
        details = details._replace(metadata=[*(details.metadata or ()), self._entry])
        return continuation(details, request)

    intercept_unary_unary = intercept_unary_stream = _add
    intercept_stream_unary = intercept_stream_stream = _add


def channel_to(address: str, timeout_s: float = 15.0) -> grpc.Channel:
    """``unix:/path`` and ``host:port`` are both gRPC targets as they are; the sender's token,
    when ``WEIGHTSYNC_TOKEN`` is set, goes with every call."""
    ch = grpc.insecure_channel(address)
    grpc.channel_ready_future(ch).result(timeout=timeout_s)
    token = os.environ.get("WEIGHTSYNC_TOKEN")
    return grpc.intercept_channel(ch, _Token(token)) if token else ch


# ---- receiver ---------------------------------------------------------------------------------


class ShmMaps:
    """Staging buffers mapped read-only, once per ``buffer_id``."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def get(self, handle) -> mmap.mmap:
        if handle.WhichOneof("kind") != "shm":
            raise ValueError(f"buffer {handle.buffer_id} is not shm")
        mm = self._maps.get(handle.buffer_id)
        if mm is None:
            fd = os.open(handle.shm.path, os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, handle.nbytes, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._maps[handle.buffer_id] = mm
        return mm


class Version:
    """One version being applied: the union of its parts' tensors (one part when whole)."""

    def __init__(self, number: int, manifests) -> None:
        self.number = number
        self.specs = {
            t.name: {"dtype": t.dtype, "shape": list(t.shape)} for m in manifests for t in m.tensors
        }
        self.data = {name: bytearray(nbytes_of(s)) for name, s in self.specs.items()}
        self.filled = dict.fromkeys(self.specs, 0)
        self.sums: dict[tuple[int, int], int] = {}  # (sender, bucket index) -> checksum
        self.ends: dict[int, object] = {}  # sender -> VersionEnd
        self.aborted: dict[int, object] = {}  # sender -> VersionAbort.reason


class Stream:
    """One ``Receive`` stream to one sender; its messages go to ``inbox`` from a thread, as
    ``(sender, "msg", message)`` and, when the sender ends the stream, ``(sender, "closed",
    status code name, details)``."""

    def __init__(self, index: int, address: str, receiver_id: str, inbox: queue.Queue) -> None:
        self.index, self.address = index, address
        self.channel = channel_to(address)
        self.requests: queue.Queue = queue.Queue()
        self.send(
            hello=pb.ReceiverHello(
                receiver_id=receiver_id,
                engine="conformance-python",
                rank=0,
                device="cpu",
                transports=["shm"],
                host_id="",  # empty: same host as the sender, map its buffers
                manifest_keys=True,  # §2.1
            )
        )
        self.manifests = KeptByKey()
        self.call = pb_grpc.WeightSyncStub(self.channel).Receive(iter(self.requests.get, None))
        first = next(self.call)
        assert first.WhichOneof("kind") == "welcome", first
        self.receiver_id = first.welcome.receiver_id
        threading.Thread(target=self._read, args=(inbox,), daemon=True).start()

    def _read(self, inbox: queue.Queue) -> None:
        try:
            for msg in self.call:
                inbox.put((self.index, "msg", msg))
        except grpc.RpcError as e:
            inbox.put((self.index, "closed", e.code().name, e.details()))
        else:
            inbox.put((self.index, "closed", "OK", ""))

    def send(self, **kind) -> None:
        self.requests.put(pb.ReceiverMessage(**kind))

    def half_close(self) -> None:
        """The orderly leave (docs/protocol.md §4): no more requests; the sender handles what
        came before and ends the stream ``OK``."""
        self.requests.put(None)


def _plan_error(message: str) -> pb.ErrorDetail:
    return pb.ErrorDetail(code="PlanError", message=message)


class Receiver:
    """Applies versions from one sender, or versions split over several (``Manifest.part``,
    docs/protocol.md §4.1): one ``Stream`` per sender."""

    def __init__(self, streams: list[Stream], reject: bool) -> None:
        self.streams, self.reject = streams, reject
        self.maps = ShmMaps()
        self.collecting: int | None = None  # the version whose starts are being collected
        self.starts: dict[int, object] = {}  # sender -> its Manifest of that version
        # sender -> its buckets and end of the version being collected, unread and unacked
        # until every part started and the verdict accepts it (§4.1)
        self.held: dict[int, list] = {}
        self.current: Version | None = None
        self.finished = 0  # versions applied, failed or rejected
        self.by_key: set[int] = set()  # versions whose manifest came by key alone (§2.1)

    def describe(self, i: int, manifest) -> str:
        address = self.streams[i].address
        if not manifest.HasField("part"):
            return f"the whole version from the sender at {address}"
        p = manifest.part
        return f"part {p.index} of {p.count} from sender {p.sender_id} at {address}"

    def refuse(self, i: int, version: int, error: pb.ErrorDetail) -> None:
        self.streams[i].send(
            verdict=pb.ManifestVerdict(version=version, accepted=False, error=error)
        )

    # -- start: collect, check, answer every sender alike --------------------------------

    def manifest(self, i: int, start):
        """``start``'s manifest: kept under its key, or the one kept (§2.1); None (refused)
        for a key this stream holds nothing under."""
        m, key, kept = start.manifest, start.manifest_key, self.streams[i].manifests
        if not key:
            return m
        if m.tensors:  # a manifest is never empty: no tensors means the key alone
            kept.keep(key, m)
            return m
        if key not in kept.known:
            why = (
                f"version {m.version}: a start came by manifest_key {key.hex()} alone, but this "
                "stream holds nothing under that key"
            )
            self.answer(m.version, {i: m}, pb.ErrorDetail(code="ProtocolError", message=why))
            return None
        whole = pb.Manifest()
        whole.CopyFrom(kept.known[key])
        whole.version = m.version
        self.by_key.add(m.version)
        return whole

    def on_start(self, i: int, start) -> None:
        m = self.manifest(i, start)
        if m is None:
            return
        v = m.version
        if self.current is not None:
            what = f"version {v} started while version {self.current.number} is still applied"
            self.refuse(i, v, pb.ErrorDetail(code="ProtocolError", message=what))
            return
        if len(self.streams) == 1:
            if m.HasField("part"):
                why = (
                    f"version {v} is {self.describe(i, m)}, but this receiver is registered "
                    "with one sender; register it with every sender"
                )
                self.answer(v, {i: m}, _plan_error(why))
            else:
                self.answer(v, {i: m}, None)
            return
        if self.collecting is None or v > self.collecting:
            for j, old in self.starts.items():  # superseded: refused
                msg = f"version {old.version} is superseded by version {v}"
                self.refuse(j, old.version, _plan_error(msg))
            self.collecting, self.starts, self.held = v, {}, {}
        elif v < self.collecting:
            msg = f"version {v} is older than version {self.collecting}, being collected"
            self.refuse(i, v, _plan_error(msg))
            return
        if i in self.starts:
            self.refuse(i, v, _plan_error(f"version {v}: a second start from one sender"))
            return
        self.starts[i] = m
        if len(self.starts) == len(self.streams):
            starts, held = self.starts, self.held
            self.collecting, self.starts, self.held = None, {}, {}
            if self.answer(v, starts, self.check_parts(v, starts)):
                for i, msgs in sorted(held.items()):  # now read what came early, in order
                    for kind, msg in msgs:
                        (self.on_bucket if kind == "bucket" else self.on_end)(i, msg)

    def check_parts(self, v: int, starts: dict) -> pb.ErrorDetail | None:
        """docs/protocol.md §4.1 step 2, before any write."""
        first_i = min(starts)
        first = starts[first_i]
        for i, m in sorted(starts.items()):
            if not m.HasField("part"):
                return _plan_error(
                    f"version {v}: {self.describe(i, m)} came beside "
                    f"{self.describe(first_i, first)}; a version is whole or split over "
                    "every sender"
                )
        want = first.part
        if want.count != len(self.streams):
            return _plan_error(
                f"version {v} is split over {want.count} senders ({self.describe(first_i, first)})"
                f" but this receiver is registered with {len(self.streams)}"
            )
        by_index: dict[int, int] = {}
        for i, m in sorted(starts.items()):
            p = m.part
            if (p.plan_digest, p.count, p.num_tensors) != (
                want.plan_digest,
                want.count,
                want.num_tensors,
            ):
                return _plan_error(
                    f"version {v}: {self.describe(i, m)} announces plan {p.plan_digest}, "
                    f"{p.count} parts, {p.num_tensors} tensors; {self.describe(first_i, first)}"
                    f" announces {want.plan_digest}, {want.count}, {want.num_tensors}"
                )
            same_lora = m.HasField("lora") == first.HasField("lora") and (
                m.lora.SerializeToString(deterministic=True)
                == first.lora.SerializeToString(deterministic=True)
            )
            if not same_lora:
                return _plan_error(f"version {v}: the parts announce different LoRA adapters")
            if p.index in by_index or p.index >= p.count:
                return _plan_error(f"version {v}: {self.describe(i, m)}: index taken or past count")
            by_index[p.index] = i
        owner: dict[str, int] = {}
        for i, m in sorted(starts.items()):
            for t in m.tensors:
                if t.name in owner:
                    return _plan_error(
                        f"version {v}: tensor {t.name!r} is in "
                        f"{self.describe(owner[t.name], starts[owner[t.name]])} and in "
                        f"{self.describe(i, m)}"
                    )
                owner[t.name] = i
        if len(owner) != want.num_tensors:
            return _plan_error(
                f"version {v}: the parts carry {len(owner)} tensors, num_tensors says "
                f"{want.num_tensors}"
            )
        return None

    def answer(self, v: int, starts: dict, error: pb.ErrorDetail | None) -> bool:
        """One verdict to every sender of the version: accepted on all or rejected on all;
        whether accepted."""
        version = Version(v, [starts[i] for i in sorted(starts)])
        if error is None:
            unknown = [n for n, s in version.specs.items() if s["dtype"] not in ITEMSIZE]
            if unknown:
                error = pb.ErrorDetail(
                    code="ManifestMismatchError",
                    message=f"unknown dtype of {unknown[0]!r}",
                    tensor=unknown[0],
                )
            elif self.reject:
                first = next(iter(version.specs), "")
                error = pb.ErrorDetail(
                    code="NameResolutionError", message="rejected on purpose", tensor=first
                )
        for i in starts:
            self.streams[i].send(
                verdict=pb.ManifestVerdict(version=v, accepted=error is None, error=error)
            )
        if error is not None:
            # Rejected before any write: the rest of this version is ignored (no acks).
            emit(event="rejected", version=v, error=to_dict(error))
            self.finished += 1
            return False
        self.current = version
        return True

    # -- buckets, end, abort ---------------------------------------------------------------

    def hold(self, i: int, version: int, kind: str, msg) -> bool:
        """Keep a bucket or end of a part whose version is still being collected."""
        if self.current is None and version == self.collecting and i in self.starts:
            self.held.setdefault(i, []).append((kind, msg))
            return True
        return False

    def on_bucket(self, i: int, b) -> None:
        if self.hold(i, b.version, "bucket", b):
            return
        cur = self.current
        if cur is None or b.version != cur.number or i in cur.aborted:
            return  # a version this receiver is not applying
        if b.sources or b.group_id or b.buffer.WhichOneof("kind") != "shm":
            raise SystemExit(f"bucket {b.layout.index}: only shm staging is implemented")
        mm = self.maps.get(b.buffer)
        data = mm[: b.layout.nbytes]  # copy out before the ack: the slot is then reused
        cur.sums[(i, b.layout.index)] = checksum(data, b.layout.nbytes)
        for e in b.layout.entries:
            name = e.tensor.name
            piece = data[e.offset : e.offset + e.nbytes]
            cur.data[name][e.tensor_offset : e.tensor_offset + e.nbytes] = piece
            cur.filled[name] += e.nbytes
        self.streams[i].send(ack=pb.BucketAck(version=b.version, index=b.layout.index, ok=True))

    def on_end(self, i: int, end) -> None:
        if self.hold(i, end.version, "end", end):
            return
        if self.current is not None and end.version == self.current.number:
            self.current.ends[i] = end
            self.finish()

    def on_abort(self, i: int, abort) -> None:
        emit(event="aborted", version=abort.version, sender=i, reason=to_dict(abort.reason))
        cur = self.current
        if cur is not None and abort.version == cur.number:
            cur.aborted[i] = abort.reason
            self.finish()
        elif abort.version == self.collecting:
            # A part that will never come: refuse the version on the senders that started it.
            for j, m in self.starts.items():
                if j != i:
                    msg = f"version {abort.version}: part from sender {i} was aborted"
                    self.refuse(j, m.version, _plan_error(msg))
            self.collecting, self.starts, self.held = None, {}, {}

    def finish(self) -> None:
        """Once every sender ended its part (``end`` or ``abort``): commit only if every part
        arrived with every checksum matching; tell every sender that did not abort."""
        cur = self.current
        if len(cur.ends) + len(cur.aborted) < len(self.streams):
            return
        error, code = None, "ChecksumError"
        if cur.aborted:
            i = min(cur.aborted)
            code = cur.aborted[i].code or "WeightSyncError"
            error = f"the part from {self.streams[i].address} was aborted: {cur.aborted[i].message}"
        for _, end in sorted(cur.ends.items()):
            if error is None and end.checksum_algorithm != CHECKSUM_ALGORITHM:
                error = f"unknown checksum algorithm {end.checksum_algorithm!r}"
        for (i, index), got in sorted(cur.sums.items()):
            sums = cur.ends[i].checksums if i in cur.ends else []
            want = sums[index] if index < len(sums) else None
            if error is None and got != want:
                error = f"sender {i} bucket {index}: checksum {got:#018x}, sender says {want}"
        short = [n for n, f in cur.filled.items() if f != len(cur.data[n])]
        if error is None and short:
            code, error = "ProtocolError", f"tensor {short[0]!r} is incomplete"
        for i in cur.ends:
            verdict = pb.VersionApplied(version=cur.number, ok=error is None)
            if error:
                verdict.error.CopyFrom(pb.ErrorDetail(code=code, message=error))
            self.streams[i].send(applied=verdict)
        emit(
            event="applied" if error is None else "failed",
            version=cur.number,
            manifest_by_key=cur.number in self.by_key,
            error=error,
            buckets=len(cur.sums),
            checksums={f"{i}/{x}": f"{v:#018x}" for (i, x), v in sorted(cur.sums.items())},
            tensors={n: {**cur.specs[n], "hex": bytes(cur.data[n]).hex()} for n in cur.specs},
        )
        self.current = None
        self.finished += 1


def receive(args) -> int:
    inbox: queue.Queue = queue.Queue()
    streams = [Stream(i, a, args.receiver_id, inbox) for i, a in enumerate(args.address)]
    ids = {s.receiver_id for s in streams}
    assert len(ids) == 1, f"the senders registered this receiver as {sorted(ids)}"
    rid = streams[0].receiver_id
    emit(event="registered", receiver_id=rid)
    rx = Receiver(streams, args.reject)
    closed: dict[int, tuple[str, str]] = {}
    handlers = {"start": rx.on_start, "bucket": rx.on_bucket, "end": rx.on_end}
    while rx.finished < args.versions:
        i, what, *rest = inbox.get()
        if what == "closed":
            raise SystemExit(f"sender {i} ended the stream mid-run: {rest}")
        msg = rest[0]
        kind = msg.WhichOneof("kind")
        if kind in handlers:
            handlers[kind](i, getattr(msg, kind))
        elif kind == "abort":
            rx.on_abort(i, msg.abort)
        elif kind == "join":
            raise SystemExit("broadcast joins are not implemented by this client")
    if not args.leave:
        sys.stdin.read()  # the test closes stdin once it has checked Status
    # The orderly leave: half-close every stream, then read each to its end (status OK).
    for s in streams:
        s.half_close()
    while len(closed) < len(streams):
        i, what, *rest = inbox.get()
        if what == "closed":
            closed[i] = tuple(rest)
    for s in streams:
        s.channel.close()
    emit(
        event="closed",
        receiver_id=rid,
        statuses=[{"code": closed[i][0], "details": closed[i][1]} for i in sorted(closed)],
    )
    return 0


# ---- publisher --------------------------------------------------------------------------------


def make_bytes(spec: dict, seed: int) -> bytes:
    """Deterministic test values: real floats for float32, their top halves for bfloat16."""
    rng = random.Random(f"{seed}/{spec['name']}")
    n = math.prod(spec["shape"])
    dtype = spec["dtype"]
    if dtype == "float32":
        return struct.pack(f"<{n}f", *(rng.uniform(-2, 2) for _ in range(n)))
    if dtype == "bfloat16":
        f32 = struct.pack(f"<{n}f", *(rng.uniform(-2, 2) for _ in range(n)))
        return b"".join(f32[i + 2 : i + 4] for i in range(0, len(f32), 4))  # little-endian
    if dtype == "int64":
        return struct.pack(f"<{n}q", *(rng.randint(-(2**62), 2**62) for _ in range(n)))
    return rng.randbytes(nbytes_of(spec))


def contiguous_strides(shape: list[int]) -> list[int]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]


def align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class ShmBuffer:
    """A shared-memory buffer this publisher owns: /dev/shm/<buffer_id>, 0600."""

    def __init__(self, nbytes: int) -> None:
        self.buffer_id = f"conformance-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = f"/dev/shm/{self.buffer_id}"
        self.nbytes = nbytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)

    def handle(self):
        return pb.BufferHandle(
            buffer_id=self.buffer_id, nbytes=self.nbytes, shm=pb.ShmHandle(path=self.path)
        )

    def close(self) -> None:
        self.mm.close()
        os.unlink(self.path)


def plan_digest(parts: list[list[dict]]) -> str:
    """An id of a split version's whole plan (every part's names, dtypes and shapes, in part
    order). docs/protocol.md §4.1 leaves its computation to the publishers: any string that
    every part carries alike and that changes with the plan."""
    text = json.dumps([[[s["name"], s["dtype"], s["shape"]] for s in p] for p in parts])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class Lane:
    """A publisher's lane (docs/protocol.md §1.1): a Unix socket to the sender, frames of a
    little-endian uint32 length and a serialized outer message; the begin's frame carries the
    descriptors of the shm sources it offers (SCM_RIGHTS)."""

    def __init__(self, offer) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(15)
        self.sock.connect(offer.path)
        self.sock.sendall(struct.pack("<I", len(offer.token)) + offer.token)
        if self.sock.recv(1) != b"\x01":
            raise SystemExit("the sender did not take this stream's lane")
        self.sock.settimeout(None)

    def send(self, msg, fds: list[int] = ()) -> None:
        body = msg.SerializeToString()
        frame = struct.pack("<I", len(body)) + body
        if not fds:
            self.sock.sendall(frame)
            return
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        sent = self.sock.sendmsg([frame], rights)  # the descriptors go with the first byte
        self.sock.sendall(frame[sent:])

    def _exactly(self, n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def replies(self):
        while (header := self._exactly(4)) is not None:
            body = self._exactly(struct.unpack("<I", header)[0])
            if body is None:
                return
            yield pb.SenderReply.FromString(body)

    def close(self) -> None:
        self.sock.close()


def _replies(replies, lane: Lane | None):
    """The sender's replies: from gRPC up to its ``lane``, then from the lane."""
    for reply in replies:
        if reply.WhichOneof("kind") == "lane":
            if lane is None:
                raise SystemExit("the sender switched to a lane this client did not take")
            yield from lane.replies()
            return
        yield reply


def publish(args) -> int:
    if args.plan:  # one part of a version split over several senders
        parts = json.loads(args.plan)
        specs = parts[args.part]
    else:
        specs = json.loads(args.tensors)
    begin = pb.BeginVersion(
        manifest=pb.Manifest(
            tensors=[
                pb.TensorSpec(name=s["name"], dtype=s["dtype"], shape=s["shape"]) for s in specs
            ],
        ),
        wait_applied=True,
    )
    if args.plan:
        begin.manifest.part.CopyFrom(
            pb.VersionPart(
                index=args.part,
                count=len(parts),
                sender_id=args.sender_id,
                plan_digest=plan_digest(parts),
                num_tensors=sum(len(p) for p in parts),
            )
        )
    own, offsets = None, {}
    if args.mode == "offer":
        # Every tensor at a 256-aligned offset of one buffer of ours; the sender maps it and
        # packs the buckets itself (no PackBucket round trips).
        end = 0
        for s in specs:
            offsets[s["name"]], end = align(end), align(end) + nbytes_of(s)
        own = ShmBuffer(max(align(end), ALIGNMENT))
        begin.sources.append(own.handle())
        for s in specs:
            begin.pieces.append(
                pb.SourcePiece(
                    name=s["name"],
                    source=0,
                    offset=offsets[s["name"]],
                    dtype=s["dtype"],
                    size=s["shape"],
                    stride=contiguous_strides(s["shape"]),
                    dst_start=[0] * len(s["shape"]),
                )
            )
    # §2.1: our key for these contents (version 0, wait_applied unset: not contents).
    contents = pb.BeginVersion()
    contents.CopyFrom(begin)
    contents.wait_applied = False
    begin.begin_key = hashlib.sha256(contents.SerializeToString(deterministic=True)).digest()[:16]
    begins_sent = SentKeys()

    ch = channel_to(args.address)
    stub = pb_grpc.WeightSyncStub(ch)
    requests: queue.Queue = queue.Queue()
    requests.put(
        pb.PublisherMessage(
            hello=pb.PublisherHello(
                publisher_id=args.publisher_id,
                rank=0,
                world_size=1,
                device="cpu",
                lanes=args.lane,
            )
        )
    )
    grpc_replies = stub.Publish(iter(requests.get, None), timeout=args.timeout_s)
    welcome = next(grpc_replies)
    assert welcome.WhichOneof("kind") == "welcome", welcome
    begins_sent.peer_keeps = welcome.welcome.begin_keys
    lane = None
    if args.lane:  # §1.1: take the lane, switch, then every message (the begin too) goes there
        if not welcome.welcome.HasField("lane"):
            raise SystemExit("asked for a lane, but the welcome offered none")
        lane = Lane(welcome.welcome.lane)
        requests.put(pb.PublisherMessage(lane=pb.LaneSwitch()))

    def send(msg, fds: list[int] = ()) -> None:
        if lane is not None:
            lane.send(msg, fds)
        else:
            requests.put(msg)

    replies = _replies(grpc_replies, lane)
    staging: dict[str, mmap.mmap] = {}
    for k, version in enumerate(range(args.version, args.version + args.versions)):
        # The same memory every version, new values in it (a trainer's step).
        data = {s["name"]: make_bytes(s, args.seed + k) for s in specs}
        if own is not None:
            for s in specs:
                own.mm[offsets[s["name"]] : offsets[s["name"]] + nbytes_of(s)] = data[s["name"]]
        alone = begins_sent.alone(begin.begin_key)
        msg = pb.BeginVersion(wait_applied=True, begin_key=begin.begin_key)
        if not alone:
            msg.CopyFrom(begin)
        msg.manifest.version = version
        if own is not None and lane is not None and not alone:
            # §6.1: one open descriptor per shm source, in the order of `sources`, with the begin.
            fd = os.open(own.path, os.O_RDONLY)
            try:
                send(pb.PublisherMessage(begin=msg), [fd])
            finally:
                os.close(fd)  # the sender got its own copy
        else:
            send(pb.PublisherMessage(begin=msg))  # a path alone: the sender asks us to pack
        packs, staged, done = [], None, None
        for reply in replies:
            kind = reply.WhichOneof("kind")
            if kind == "pack" and reply.pack.version == version:
                handle = reply.pack.buffer
                mm = staging.get(handle.buffer_id)
                if mm is None:
                    fd = os.open(handle.shm.path, os.O_RDWR)
                    try:
                        mm = staging[handle.buffer_id] = mmap.mmap(fd, handle.nbytes)
                    finally:
                        os.close(fd)
                layout = reply.pack.layout
                for e in layout.entries:
                    src = data[e.tensor.name][e.tensor_offset : e.tensor_offset + e.nbytes]
                    mm[e.offset : e.offset + e.nbytes] = src
                packs.append(layout.index)
                send(
                    pb.PublisherMessage(packed=pb.BucketPacked(version=version, index=layout.index))
                )
            elif kind == "staged" and reply.staged.version == version:
                staged = reply.staged  # our memory is no longer read: free to change it
            elif kind == "done" and reply.done.version == version:
                done = reply.done
                break
        emit(
            event="published",
            version=version,
            begin_by_key=alone,
            lane=lane is not None,
            welcome=to_dict(welcome.welcome),
            staged=to_dict(staged) if staged else None,
            done=to_dict(done) if done else None,
            packs=packs,
            tensors={
                s["name"]: {"dtype": s["dtype"], "shape": s["shape"], "hex": data[s["name"]].hex()}
                for s in specs
            },
        )
    if lane is not None:
        lane.sock.shutdown(socket.SHUT_WR)  # our end of both: the lane and the gRPC stream
    requests.put(None)
    for mm in staging.values():
        mm.close()
    if own is not None:
        own.close()
    if lane is not None:
        lane.close()
    ch.close()
    return 0


# ---- queries and errors -----------------------------------------------------------------------


def status(args) -> int:
    ch = channel_to(args.address)
    reply = pb_grpc.WeightSyncStub(ch).Status(pb.StatusRequest(), timeout=10)
    emit(event="status", status=to_dict(reply))
    ch.close()
    return 0


def wait_applied(args) -> int:
    ch = channel_to(args.address)
    reply = pb_grpc.WeightSyncStub(ch).WaitApplied(
        pb.WaitAppliedRequest(version=args.version, timeout_s=args.timeout_s),
        timeout=args.timeout_s + 5,
    )
    emit(event="wait_applied", version=to_dict(reply.version))
    ch.close()
    return 0


def _status_of(call) -> dict:
    try:
        for _ in call:
            pass
    except grpc.RpcError as e:
        return {"code": e.code().name, "details": e.details()}
    return {"code": "OK", "details": ""}


def errors(args) -> int:
    """Each case opens a stream that breaks a rule and records the status it ends with."""
    ch = channel_to(args.address)
    stub = pb_grpc.WeightSyncStub(ch)
    out = {}

    def begin(version: int, tensors) -> pb.PublisherMessage:
        return pb.PublisherMessage(
            begin=pb.BeginVersion(manifest=pb.Manifest(version=version, tensors=tensors))
        )

    def publish_once(version: int, tensors, device: str = "cpu", timeout_s: float = 10) -> dict:
        """hello, begin; half-close after `staged` (or at the first error)."""
        hello = pb.PublisherHello(publisher_id="conformance-errors", device=device)
        requests: queue.Queue = queue.Queue()
        requests.put(pb.PublisherMessage(hello=hello))
        requests.put(begin(version, tensors))
        call = stub.Publish(iter(requests.get, None), timeout=timeout_s)
        kinds = []
        try:
            for reply in call:
                kinds.append(reply.WhichOneof("kind"))
                if kinds[-1] == "pack":  # every byte of the entries written (zeros) first
                    handle = reply.pack.buffer
                    fd = os.open(handle.shm.path, os.O_RDWR)
                    try:
                        with mmap.mmap(fd, handle.nbytes) as mm:
                            for e in reply.pack.layout.entries:
                                mm[e.offset : e.offset + e.nbytes] = bytes(e.nbytes)
                    finally:
                        os.close(fd)
                    index = reply.pack.layout.index
                    requests.put(
                        pb.PublisherMessage(packed=pb.BucketPacked(version=version, index=index))
                    )
                if kinds[-1] == "staged":
                    requests.put(None)
        except grpc.RpcError as e:
            requests.put(None)
            return {"code": e.code().name, "details": e.details(), "replies": kinds}
        return {"code": "OK", "details": "", "replies": kinds}

    one = [pb.TensorSpec(name="w", dtype="float32", shape=[4])]
    if args.empty_device:
        out["publish_empty_device"] = publish_once(args.version, one, device="", timeout_s=3)
        emit(event="errors", cases=out)
        ch.close()
        return 0

    begin_first = begin(args.version, one)
    out["publish_without_hello"] = _status_of(stub.Publish(iter([begin_first]), timeout=10))
    out["publish_ok"] = publish_once(args.version, one)
    out["publish_same_version_again"] = publish_once(args.version, one)
    out["publish_version_zero"] = publish_once(0, one)
    out["publish_duplicate_names"] = publish_once(args.version + 1, one + one)
    out["publish_unknown_dtype"] = publish_once(
        args.version + 1, [pb.TensorSpec(name="w", dtype="complex32", shape=[4])]
    )
    # A part of a split version (§4.1) whose index is past its count.
    part = pb.BeginVersion(
        manifest=pb.Manifest(
            version=args.version + 1,
            tensors=one,
            part=pb.VersionPart(
                index=2, count=2, sender_id="host-a", plan_digest="d", num_tensors=2
            ),
        )
    )
    hello = pb.PublisherMessage(
        hello=pb.PublisherHello(publisher_id="conformance-errors", device="cpu")
    )
    out["publish_part_past_count"] = _status_of(
        stub.Publish(iter([hello, pb.PublisherMessage(begin=part)]), timeout=10)
    )
    # §2.1: a begin by a key this (new) stream never sent its contents with.
    by_key = pb.BeginVersion(manifest=pb.Manifest(version=args.version + 1), begin_key=b"\x01\x02")
    out["publish_by_unknown_key"] = _status_of(
        stub.Publish(iter([hello, pb.PublisherMessage(begin=by_key)]), timeout=10)
    )

    ack = pb.ReceiverMessage(ack=pb.BucketAck(version=1, index=0, ok=True))
    out["receive_without_hello"] = _status_of(stub.Receive(iter([ack]), timeout=10))

    # A receiver id that is connected already: the new stream takes it over, the old one ends.
    rid = f"conformance-dup-{uuid.uuid4().hex[:6]}"
    hello = pb.ReceiverMessage(hello=pb.ReceiverHello(receiver_id=rid, engine="conformance"))
    gate = threading.Event()

    def held():
        yield hello
        gate.wait()

    first = stub.Receive(held(), timeout=10)
    assert next(first).welcome.receiver_id == rid
    second = stub.Receive(held(), timeout=10)
    assert next(second).welcome.receiver_id == rid
    out["replaced_receiver_id"] = _status_of(first)
    gate.set()
    second.cancel()
    emit(event="errors", cases=out)
    ch.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("checksum")
    for name in ("status", "wait-applied", "receive", "publish", "errors"):
        s = sub.add_parser(name)
        if name == "receive":  # one address per sender: several for a split version (§4.1)
            s.add_argument("--address", required=True, action="append")
        else:
            s.add_argument("--address", required=True)
        if name == "wait-applied":
            s.add_argument("version", type=int)
            s.add_argument("--timeout-s", type=float, default=30.0)
        if name == "receive":
            s.add_argument("--receiver-id", default="")
            s.add_argument("--versions", type=int, default=1)
            s.add_argument("--reject", action="store_true", help="reject every manifest")
            s.add_argument(
                "--leave", action="store_true", help="leave right after the last version"
            )
        if name == "publish":
            s.add_argument("--version", type=int, required=True)
            s.add_argument("--versions", type=int, default=1, help="on one stream")
            what = s.add_mutually_exclusive_group(required=True)
            what.add_argument("--tensors", help="JSON: [{name, dtype, shape}, ...]")
            what.add_argument("--plan", help="JSON: every part's tensors, for a split version")
            s.add_argument("--part", type=int, default=0, help="with --plan: this part")
            s.add_argument("--sender-id", default="", help="with --plan: names this part")
            s.add_argument("--seed", type=int, default=0)
            s.add_argument("--mode", choices=["offer", "pack"], required=True)
            s.add_argument(
                "--lane", action="store_true", help="take a lane; offer shm by descriptor"
            )
            s.add_argument("--publisher-id", default=f"conformance-{os.getpid()}")
            s.add_argument("--timeout-s", type=float, default=60.0)
        if name == "errors":
            s.add_argument("--version", type=int, required=True)
            s.add_argument("--empty-device", action="store_true", help="only that case")
    args = p.parse_args()
    if args.cmd == "checksum":
        data = bytes.fromhex(sys.stdin.read().strip())
        emit(event="checksum", nbytes=len(data), value=f"{checksum(data, len(data)):#018x}")
        return 0
    return {
        "status": status,
        "wait-applied": wait_applied,
        "receive": receive,
        "publish": publish,
        "errors": errors,
    }[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
