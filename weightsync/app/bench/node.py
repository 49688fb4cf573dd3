"""The node case of ``weightsync bench --gpus N`` (issue 11): every trainer rank a source.

Trainer TP=1 x DP=N: one publisher rank process per GPU, each holding the whole model there
(as one flat buffer, like Megatron's parameter buffers). Engines TP=1 x N: one receiver process
per GPU. Direct path: each receiver should read every tensor from the copy on its own GPU.
The floor, in the same run: every GPU copying its share (here the whole model) from its own
memory at once, one process per GPU.

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

from weightsync.app.bench.models import ModelShape, hf_specs
from weightsync.app.bench.report import FLOOR, NODE_FLOOR, WEIGHTSYNC, Row
from weightsync.errors import ConfigError
from weightsync.receiver.target import InPlaceTarget


@dataclass(frozen=True)
class NodeRun:
    """One node measurement."""

    gpus: int
    nbytes: int
    """Bytes of the model, which every GPU holds and receives."""
    applied_s: tuple[float, ...]
    """Each measured version's ``complete_s``."""
    floor_s: tuple[float, ...]
    """Each floor repetition's slowest GPU."""
    route_bytes: dict[str, int]
    """The last version's bytes by route, all receivers together."""
    bit_exact: bool

    def rows(self) -> list[Row]:
        layout, placement = f"TP=1 x DP={self.gpus}", node_placement(self.gpus)
        routes = ", ".join(f"{k} {n / 1e9:.1f} GB" for k, n in self.route_bytes.items() if n)
        return [
            Row(FLOOR, NODE_FLOOR, "-", layout, placement, self.nbytes, self.floor_s),
            Row(
                WEIGHTSYNC,
                "direct",
                "cuda_ipc",
                layout,
                placement,
                self.nbytes,
                self.applied_s,
                bit_exact=self.bit_exact,
                note=f"engines TP=1 x {self.gpus}; routes: {routes}",
                failed=not self.bit_exact,
            ),
        ]


def node_placement(gpus: int) -> str:
    """The receivers' placement in the report: one per GPU of ``gpus``."""
    return f"node: {gpus} GPUs"


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


class _ViewsTarget(InPlaceTarget):
    """Loads by HF name into views of the receiver's flat buffer."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.device = next(iter(tensors.values())).device

    def validate(self, manifest) -> None:
        self.check_shapes(manifest)

    def live_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def _mismatch(tensors: dict[str, torch.Tensor], flat, expected, version: int) -> str:
    """Empty when ``flat`` holds version ``version``'s bytes, else which tensors differ."""
    if torch.equal(flat, expected):
        return ""
    offset, wrong = 0, []
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if not torch.equal(flat[offset : offset + n], expected[offset : offset + n]):
            wrong.append(name)
        offset += n
    return f"version {version}: {len(wrong)} tensor(s) differ, first {wrong[:3]}"


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


def _receiver(shape, rank: int, address: str, versions: int, reps: int, timeout_s, barrier, out):
    from weightsync.receiver.core import ReceiverCore

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    flat, tensors = _model(shape, device)
    expected = torch.empty_like(flat)
    receiver = ReceiverCore(_ViewsTarget(tensors), address, receiver_id=f"gpu{rank}")
    out.put(("ready", rank))
    for _ in range(versions):
        version = receiver.sync(timeout=timeout_s)
        _fill(expected, version)
        out.put(("applied", rank, _mismatch(tensors, flat, expected, version)))
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        barrier.wait()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        flat.copy_(expected)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    out.put(("floor", rank, times[1:]))
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
    shape: ModelShape, gpus: int, versions: int, warmup: int, reps: int, timeout_s: float
) -> NodeRun:
    """Run the node case on GPUs 0..``gpus``-1: ``warmup`` + ``versions`` versions, then
    ``reps`` floor repetitions.

    Raises:
        ConfigError: fewer GPUs than ``gpus``.
    """
    from weightsync.sender import Sender
    from weightsync.v1 import weightsync_pb2 as pb

    if not 1 <= gpus <= torch.cuda.device_count():
        raise ConfigError(f"--gpus {gpus}: this machine has {torch.cuda.device_count()} GPU(s)")
    total = warmup + versions
    ctx = mp.get_context("spawn")
    out, barrier = ctx.Queue(), ctx.Barrier(gpus)
    commands = [ctx.Queue() for _ in range(gpus)]
    sock_dir = tempfile.mkdtemp(prefix="ws-node-", dir="/tmp")
    procs: list = []
    try:
        with Sender(f"unix:{sock_dir}/s.sock", ack_timeout_s=timeout_s) as sender:
            for r in range(gpus):
                args = (shape, r, sender.address, total, reps, timeout_s, barrier, out)
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
        sum(s.nbytes for s in hf_specs(shape)),
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
        f"node: trainer TP=1 x DP={run.gpus}, engines TP=1 x {run.gpus}, "
        f"{run.nbytes / 1e9:.2f} GB per GPU, direct: applied {applied * 1e3:.1f} ms (median of "
        f"{len(run.applied_s)}), bit-exact {run.bit_exact}, route bytes {run.route_bytes}\n"
        f"floor: every GPU copying its {run.nbytes / 1e9:.2f} GB from its own memory at once "
        f"({run.gpus} processes): {floor * 1e3:.2f} ms; applied / floor = {applied / floor:.2f}x"
    )
