"""The node case of ``weightsync bench --gpus N`` (issue 11): every trainer rank a source.

Trainer TP=1 x DP=N: one publisher rank process per GPU, each holding the whole model there
(as one flat buffer, like Megatron's parameter buffers). Engines TP=T x N/T: one receiver
process per GPU holding an engine-like model (vLLM's packing and, for T > 1, its TP shards:
``engine_like.engine_shard``). Direct path: each receiver should read what it keeps from the
copy on its own GPU, and with T > 1 only its shard's bytes. The floor, in the same run: every
GPU copying its share (the bytes its engine rank keeps) from its own memory at once, one
process per GPU.

Timing: the sender's ``complete_s`` of each version (the last rank joined -> every receiver
applied), median over the measured versions; the floor per repetition is its slowest GPU.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from weightsync.app.bench.engine_like import EngineLikeModel, EngineLikeTarget
from weightsync.app.bench.models import ModelShape, hf_specs
from weightsync.app.bench.report import FLOOR, NODE_FLOOR, WEIGHTSYNC, Row
from weightsync.errors import ConfigError


@dataclass(frozen=True)
class NodeRun:
    """One node measurement."""

    gpus: int
    engine_tp: int
    nbytes: int
    """Bytes of the model, which every GPU's trainer rank holds."""
    kept_nbytes: int
    """Bytes one engine rank keeps (``nbytes`` / ``engine_tp``, replicated norms aside)."""
    applied_s: tuple[float, ...]
    """Each measured version's ``complete_s``."""
    floor_s: tuple[float, ...]
    """Each floor repetition's slowest GPU."""
    route_bytes: dict[str, int]
    """The last version's bytes by route, all receivers together."""
    bit_exact: bool

    def rows(self) -> list[Row]:
        layout = f"TP=1 x DP={self.gpus}"
        placement = node_placement(self.gpus, self.engine_tp)
        # Route bytes count what each receiver keeps: a TP rank declares its shard.
        routes = ", ".join(f"{k} {n / 1e9:.1f} GB" for k, n in self.route_bytes.items() if n)
        return [
            Row(FLOOR, NODE_FLOOR, "-", layout, placement, self.kept_nbytes, self.floor_s),
            Row(
                WEIGHTSYNC,
                "direct",
                "cuda_ipc",
                layout,
                placement,
                self.kept_nbytes,
                self.applied_s,
                bit_exact=self.bit_exact,
                note=f"engines TP={self.engine_tp} x {self.gpus // self.engine_tp}; "
                f"routes: {routes}",
                failed=not self.bit_exact,
            ),
        ]


def node_placement(gpus: int, engine_tp: int = 1) -> str:
    """The receivers' placement in the report: one per GPU of ``gpus``."""
    return f"node: {gpus} GPUs" + (f", engines TP={engine_tp}" if engine_tp > 1 else "")


def _model(shape: ModelShape, device: torch.device):
    """One flat byte buffer and every HF tensor a view of it, back to back."""
    specs = hf_specs(shape)
    flat = torch.empty(sum(s.nbytes for s in specs), dtype=torch.uint8, device=device)
    tensors, offset = {}, 0
    for s in specs:
        tensors[s.name] = flat[offset : offset + s.nbytes].view(s.torch_dtype).view(s.shape)
        offset += s.nbytes
    return flat, tensors


def _fill(flat: torch.Tensor, version: int) -> None:
    """Version ``version``'s bytes: the same on every GPU (one seed, one size)."""
    flat.random_(0, 256, generator=torch.Generator(flat.device).manual_seed(version))


def _mismatch(target: EngineLikeTarget, expected: dict[str, torch.Tensor], version: int) -> str:
    """Empty when every tensor's kept part equals version ``version``'s, else which differ."""
    wrong = []
    for name, full in expected.items():
        kept = target.shard(name, tuple(full.shape)).of(full)
        if not torch.equal(target.resolve(name).view(torch.int16), kept.view(torch.int16)):
            wrong.append(name)
    return f"version {version}: {len(wrong)} tensor(s) differ, first {wrong[:3]}" if wrong else ""


def _publisher(shape, rank: int, world: int, address: str, timeout_s: float, commands, out):
    from weightsync.sender import Publisher

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    flat, tensors = _model(shape, device)
    with Publisher(address, publisher_id="node", rank=rank, world_size=world) as publisher:
        while (version := commands.get()) is not None:
            _fill(flat, version)
            torch.cuda.synchronize(device)
            result = publisher.publish(
                tensors, version, wait=True, timeout_s=timeout_s, direct=True
            )
            out.put(("published", rank, result.status.SerializeToString()))


def _receiver(
    shape, rank: int, engine_tp: int, address: str, versions, reps, timeout_s, barrier, out
):
    from weightsync.receiver.core import ReceiverCore

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    model = EngineLikeModel(shape, device, tp=engine_tp, rank=rank % engine_tp)
    target = EngineLikeTarget(model)
    expected_flat, expected = _model(shape, device)
    receiver = ReceiverCore(target, address, receiver_id=f"gpu{rank}")
    out.put(("ready", rank))
    for _ in range(versions):
        version = receiver.sync(timeout=timeout_s)
        _fill(expected_flat, version)
        out.put(("applied", rank, _mismatch(target, expected, version)))
    kept = sum(p.nbytes for p in model.parameters())
    share = torch.empty(kept, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        barrier.wait()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        share.copy_(expected_flat[:kept])
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    out.put(("floor", rank, times[1:], kept))
    receiver.close()


def _collect(out, counts: dict[str, int], timeout_s: float) -> dict[str, list[tuple]]:
    """The next reports of the processes: ``counts[kind]`` of each kind, in any order."""
    got: dict[str, list[tuple]] = {kind: [] for kind in counts}
    while any(len(got[k]) < n for k, n in counts.items()):
        item = out.get(timeout=timeout_s)
        if len(got.get(item[0], ())) >= counts.get(item[0], 0):
            raise RuntimeError(f"node bench: unexpected report {item[:2]!r}")
        got[item[0]].append(item)
    return got


def measure_node(
    shape: ModelShape,
    gpus: int,
    versions: int,
    warmup: int,
    reps: int,
    timeout_s: float,
    engine_tp: int = 1,
) -> NodeRun:
    """Run the node case on GPUs 0..``gpus``-1 with engines of TP ``engine_tp``: ``warmup`` +
    ``versions`` versions, then ``reps`` floor repetitions.

    Raises:
        ConfigError: fewer GPUs than ``gpus``, or ``gpus`` not a multiple of ``engine_tp``.
    """
    from weightsync.sender import Sender
    from weightsync.v1 import weightsync_pb2 as pb

    if not 1 <= gpus <= torch.cuda.device_count():
        raise ConfigError(f"--gpus {gpus}: this machine has {torch.cuda.device_count()} GPU(s)")
    if engine_tp < 1 or gpus % engine_tp:
        raise ConfigError(f"--engine-tp {engine_tp}: --gpus {gpus} must be a multiple of it")
    total = warmup + versions
    ctx = mp.get_context("spawn")
    out, barrier = ctx.Queue(), ctx.Barrier(gpus)
    commands = [ctx.Queue() for _ in range(gpus)]
    sock_dir = tempfile.mkdtemp(prefix="ws-node-", dir="/tmp")
    procs: list = []
    try:
        with Sender(f"unix:{sock_dir}/s.sock", ack_timeout_s=timeout_s) as sender:
            for r in range(gpus):
                args = (shape, r, engine_tp, sender.address, total, reps, timeout_s, barrier, out)
                procs.append(ctx.Process(target=_receiver, args=args, daemon=True))
                procs[-1].start()
            _collect(out, {"ready": gpus}, timeout_s)
            for r in range(gpus):
                args = (shape, r, gpus, sender.address, timeout_s, commands[r], out)
                procs.append(ctx.Process(target=_publisher, args=args, daemon=True))
                procs[-1].start()
            statuses, exact = [], True
            for version in range(1, total + 1):
                for q in commands:
                    q.put(version)
                got = _collect(out, {"published": gpus, "applied": gpus}, timeout_s)
                statuses.append(pb.VersionStatus.FromString(got["published"][0][2]))
                wrong = [f"gpu{rank} {why}" for _, rank, why in got["applied"] if why]
                exact = exact and not wrong
                for line in wrong:
                    print(f"node bench: NOT bit-exact: {line}", flush=True)
            floors = _collect(out, {"floor": gpus}, timeout_s)["floor"]
            for q in commands:
                q.put(None)
            for p in procs:
                p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        shutil.rmtree(sock_dir, ignore_errors=True)
    measured = statuses[warmup:]
    return NodeRun(
        gpus,
        engine_tp,
        sum(s.nbytes for s in hf_specs(shape)),
        max(f[3] for f in floors),
        tuple(s.complete_s for s in measured),
        tuple(max(f[2][i] for f in floors) for i in range(reps)),
        dict(measured[-1].route_bytes),
        exact,
    )


def summary(run: NodeRun) -> str:
    """Two lines: the node's timing and the floor."""
    applied = statistics.median(run.applied_s)
    floor = statistics.median(run.floor_s)
    return (
        f"node: trainer TP=1 x DP={run.gpus}, engines TP={run.engine_tp} x "
        f"{run.gpus // run.engine_tp}, {run.nbytes / 1e9:.2f} GB per trainer GPU, "
        f"{run.kept_nbytes / 1e9:.2f} GB kept per engine GPU, direct: applied "
        f"{applied * 1e3:.1f} ms (median of {len(run.applied_s)}), bit-exact {run.bit_exact}, "
        f"route bytes {run.route_bytes}\n"
        f"floor: every GPU copying its {run.kept_nbytes / 1e9:.2f} GB from its own memory at "
        f"once ({run.gpus} processes): {floor * 1e3:.2f} ms; applied / floor = "
        f"{applied / floor:.2f}x"
    )
