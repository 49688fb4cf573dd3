"""A weightsync control-plane client written from docs/protocol.md and the .proto alone.

It runs in its own process with only grpcio, protobuf and stubs generated from
``proto/weightsync/v1/weightsync.proto`` at test time (``weightsync_pb2``): importing
``weightsync`` (or torch) here fails on purpose, so nothing of the implementation leaks in.

Commands (each prints JSON lines on stdout):

- ``checksum``: the bucket checksum of the bytes written in hex on stdin (docs/protocol.md).
- ``status``: the sender's ``Status`` reply.
- ``wait-applied V``: ``WaitApplied(V)``.
- ``receive``: register, then apply ``--versions`` versions from shm staging buffers,
  verifying every bucket's checksum; prints one ``applied`` line per version with each
  tensor's bytes; leaves when stdin closes.
- ``publish``: publish one version of ``--tensors`` (JSON: name, dtype, shape) with bytes made
  from ``--seed``; ``--mode offer`` places them in a shared-memory buffer of its own and offers
  it (the sender packs), ``--mode pack`` packs each bucket into the sender's staging buffer
  when asked.
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
import json  # noqa: E402
import math  # noqa: E402
import mmap  # noqa: E402
import os  # noqa: E402
import queue  # noqa: E402
import random  # noqa: E402
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
    def __init__(self, manifest) -> None:
        self.number = manifest.version
        self.specs = {t.name: {"dtype": t.dtype, "shape": list(t.shape)} for t in manifest.tensors}
        self.data = {name: bytearray(nbytes_of(s)) for name, s in self.specs.items()}
        self.filled = dict.fromkeys(self.specs, 0)
        self.sums: dict[int, int] = {}


def receive(args) -> int:
    ch = channel_to(args.address)
    stub = pb_grpc.WeightSyncStub(ch)
    requests: queue.Queue = queue.Queue()
    requests.put(
        pb.ReceiverMessage(
            hello=pb.ReceiverHello(
                receiver_id=args.receiver_id,
                engine="conformance-python",
                rank=0,
                device="cpu",
                transports=["shm"],
                host_id="",  # empty: same host as the sender, map its buffers
            )
        )
    )
    stream = stub.Receive(iter(requests.get, None))
    first = next(stream)
    assert first.WhichOneof("kind") == "welcome", first
    rid = first.welcome.receiver_id
    emit(event="registered", receiver_id=rid)

    def send(**kind) -> None:
        requests.put(pb.ReceiverMessage(**kind))

    maps = ShmMaps()
    current: Version | None = None
    applied = 0
    for msg in stream:
        kind = msg.WhichOneof("kind")
        if kind == "start":
            current = Version(msg.start.manifest)
            unknown = [n for n, s in current.specs.items() if s["dtype"] not in ITEMSIZE]
            if unknown or args.reject:
                # Rejected before any write: ignore the rest of this version (no acks).
                first = (unknown or list(current.specs) or [""])[0]
                reason = f"unknown dtype of {first!r}" if unknown else "rejected on purpose"
                error = pb.ErrorDetail(code="NameResolutionError", message=reason, tensor=first)
                send(
                    verdict=pb.ManifestVerdict(version=current.number, accepted=False, error=error)
                )
                emit(event="rejected", version=current.number, error=to_dict(error))
                current = None
                applied += 1
                if applied >= args.versions:
                    break
                continue
            send(verdict=pb.ManifestVerdict(version=current.number, accepted=True))
        elif kind == "bucket":
            b = msg.bucket
            if current is None or b.version != current.number:
                continue  # a version this receiver is not applying
            if b.sources or b.group_id or b.buffer.WhichOneof("kind") != "shm":
                raise SystemExit(f"bucket {b.layout.index}: only shm staging is implemented")
            mm = maps.get(b.buffer)
            data = mm[: b.layout.nbytes]  # copy out before the ack: the slot is then reused
            current.sums[b.layout.index] = checksum(data, b.layout.nbytes)
            for e in b.layout.entries:
                name = e.tensor.name
                piece = data[e.offset : e.offset + e.nbytes]
                current.data[name][e.tensor_offset : e.tensor_offset + e.nbytes] = piece
                current.filled[name] += e.nbytes
            send(ack=pb.BucketAck(version=b.version, index=b.layout.index, ok=True))
        elif kind == "end":
            end = msg.end
            if current is None or end.version != current.number:
                continue
            error = None
            if end.checksum_algorithm != CHECKSUM_ALGORITHM:
                error = f"unknown checksum algorithm {end.checksum_algorithm!r}"
            for index, got in sorted(current.sums.items()):
                want = end.checksums[index] if index < len(end.checksums) else None
                if error is None and got != want:
                    error = f"bucket {index}: checksum {got:#018x}, sender says {want}"
            short = [n for n, f in current.filled.items() if f != len(current.data[n])]
            if error is None and short:
                error = f"tensor {short[0]!r} is incomplete"
            verdict = pb.VersionApplied(version=current.number, ok=error is None)
            if error:
                verdict.error.CopyFrom(pb.ErrorDetail(code="ChecksumError", message=error))
            send(applied=verdict)
            emit(
                event="applied" if error is None else "failed",
                version=current.number,
                error=error,
                buckets=len(current.sums),
                checksums={str(i): f"{v:#018x}" for i, v in current.sums.items()},
                tensors={
                    n: {**current.specs[n], "hex": bytes(current.data[n]).hex()}
                    for n in current.specs
                },
            )
            current = None
            applied += 1
            if applied >= args.versions:
                break
        elif kind == "abort":
            emit(event="aborted", version=msg.abort.version, reason=to_dict(msg.abort.reason))
            current = None
        elif kind == "join":
            raise SystemExit("broadcast joins are not implemented by this client")
    sys.stdin.read()  # the test closes stdin once it has checked Status
    requests.put(None)  # half-close: the sender ends the stream and marks us disconnected
    for _ in stream:
        pass
    ch.close()
    emit(event="closed", receiver_id=rid)
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


def publish(args) -> int:
    specs = json.loads(args.tensors)
    data = {s["name"]: make_bytes(s, args.seed) for s in specs}
    begin = pb.BeginVersion(
        manifest=pb.Manifest(
            version=args.version,
            tensors=[
                pb.TensorSpec(name=s["name"], dtype=s["dtype"], shape=s["shape"]) for s in specs
            ],
        ),
        wait_applied=True,
    )
    own = None
    if args.mode == "offer":
        # Every tensor at a 256-aligned offset of one buffer of ours; the sender maps it and
        # packs the buckets itself (no PackBucket round trips).
        offsets, end = {}, 0
        for s in specs:
            offsets[s["name"]], end = align(end), align(end) + nbytes_of(s)
        own = ShmBuffer(max(align(end), ALIGNMENT))
        for s in specs:
            own.mm[offsets[s["name"]] : offsets[s["name"]] + nbytes_of(s)] = data[s["name"]]
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

    ch = channel_to(args.address)
    stub = pb_grpc.WeightSyncStub(ch)
    requests: queue.Queue = queue.Queue()
    requests.put(
        pb.PublisherMessage(
            hello=pb.PublisherHello(
                publisher_id=args.publisher_id, rank=0, world_size=1, device="cpu"
            )
        )
    )
    replies = stub.Publish(iter(requests.get, None), timeout=args.timeout_s)
    welcome = next(replies)
    assert welcome.WhichOneof("kind") == "welcome", welcome
    requests.put(pb.PublisherMessage(begin=begin))
    staging: dict[str, mmap.mmap] = {}
    packs, staged, done = [], None, None
    for reply in replies:
        kind = reply.WhichOneof("kind")
        if kind == "pack" and reply.pack.version == args.version:
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
            requests.put(
                pb.PublisherMessage(
                    packed=pb.BucketPacked(version=args.version, index=layout.index)
                )
            )
        elif kind == "staged" and reply.staged.version == args.version:
            staged = reply.staged  # our memory is no longer read: free to change it
            if own is not None:
                own.close()
                own = None
        elif kind == "done" and reply.done.version == args.version:
            done = reply.done
            break
    requests.put(None)
    for mm in staging.values():
        mm.close()
    ch.close()
    emit(
        event="published",
        welcome=to_dict(welcome.welcome),
        staged=to_dict(staged) if staged else None,
        done=to_dict(done) if done else None,
        packs=packs,
        tensors={
            s["name"]: {"dtype": s["dtype"], "shape": s["shape"], "hex": data[s["name"]].hex()}
            for s in specs
        },
    )
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
                if kinds[-1] == "pack":  # leave the bytes as they are: nobody reads them
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
        s.add_argument("--address", required=True)
        if name == "wait-applied":
            s.add_argument("version", type=int)
            s.add_argument("--timeout-s", type=float, default=30.0)
        if name == "receive":
            s.add_argument("--receiver-id", default="")
            s.add_argument("--versions", type=int, default=1)
            s.add_argument("--reject", action="store_true", help="reject every manifest")
        if name == "publish":
            s.add_argument("--version", type=int, required=True)
            s.add_argument("--tensors", required=True)
            s.add_argument("--seed", type=int, default=0)
            s.add_argument("--mode", choices=["offer", "pack"], required=True)
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
