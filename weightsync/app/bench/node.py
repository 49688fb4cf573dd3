"""The node case of ``weightsync bench --gpus N`` (issue 11): every trainer rank a source.

Trainer TP=T x DP=N/T: one publisher rank process per GPU, rank r holding TP shard r % T of
every tensor (:mod:`.layout`: one flat buffer per rank, like Megatron's parameter buffers;
T=1: the whole model). Engines TP=E x N/E: one receiver process per GPU holding an engine-like
model (vLLM's packing and, for E > 1, its TP shards: ``engine_like.engine_shard``). Direct
path: each receiver should read what it keeps from the copies on its own GPU first (a tensor
the trainer shards: its pieces, read in place), and with E > 1 only its shard's bytes. The
floors, in the same run: every GPU copying its share (the bytes its engine rank keeps) from its
own memory at once, one process per GPU; and the interconnect floor, the larger of that and
the peer bytes into each GPU (every GPU receives as many here) over the best peer bandwidth
measured alone, GPU 0 taking 2 GB from GPU 1 (torch's copy, or :mod:`~weightsync.peer_copies`).

Timing: the sender's ``complete_s`` of each version (the last rank joined -> every receiver
applied), median over the measured versions; the floor per repetition is its slowest GPU.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from weightsync.app.bench.engine_like import EngineLikeModel, EngineLikeTarget
from weightsync.app.bench.layout import TrainerShards, plan_layout
from weightsync.app.bench.models import ModelShape, hf_specs
from weightsync.app.bench.report import FLOOR, NODE_FLOOR, NODE_LINK_FLOOR, WEIGHTSYNC, Row
from weightsync.errors import ConfigError, SyncTimeoutError, WeightSyncError
from weightsync.manifest import VersionManifest


@dataclass(frozen=True)
class NodeRun:
    """One node measurement."""

    gpus: int
    engine_tp: int
    nbytes: int
    """Bytes of the model."""
    kept_nbytes: int
    """Bytes one engine rank keeps (``nbytes`` / ``engine_tp``, replicated norms aside)."""
    applied_s: tuple[float, ...]
    """Each measured version's ``complete_s``."""
    floor_s: tuple[float, ...]
    """Each floor repetition's slowest GPU."""
    route_bytes: dict[str, int]
    """The last version's bytes by route, all receivers together."""
    bit_exact: bool
    trainer_tp: int = 1
    peer_bytes_per_s: float | None = None
    """The best peer bandwidth measured (one GPU from one peer, alone); None on one GPU."""

    @property
    def layout(self) -> str:
        return f"TP={self.trainer_tp} x DP={self.gpus // self.trainer_tp}"

    @property
    def link_floor_s(self) -> tuple[float, ...]:
        """Per repetition: the larger of the local floor and the peer bytes into one GPU over
        the best peer bandwidth."""
        peer = self.route_bytes.get("peer", 0) / self.gpus
        link = peer / self.peer_bytes_per_s if self.peer_bytes_per_s else 0.0
        return tuple(max(s, link) for s in self.floor_s)

    def rows(self) -> list[Row]:
        placement = node_placement(self.gpus, self.engine_tp)
        # Route bytes count what each receiver keeps: a TP rank declares its shard.
        routes = ", ".join(f"{k} {n / 1e9:.1f} GB" for k, n in self.route_bytes.items() if n)
        bw = self.peer_bytes_per_s
        return [
            Row(FLOOR, NODE_FLOOR, "-", self.layout, placement, self.kept_nbytes, self.floor_s),
            Row(
                FLOOR,
                NODE_LINK_FLOOR,
                "-",
                self.layout,
                placement,
                self.kept_nbytes,
                self.link_floor_s,
                note=f"peer {bw / 1e9:.0f} GB/s" if bw else "one GPU: no peer route",
            ),
            Row(
                WEIGHTSYNC,
                "direct",
                "cuda_ipc",
                self.layout,
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


def _shards(shape: ModelShape, trainer_tp: int, device: torch.device) -> TrainerShards:
    """Every TP rank's flat buffer of a TP=``trainer_tp`` trainer, on ``device``: a publisher
    offers its own rank's, a receiver assembles the expected tensors from all of them."""
    layout = plan_layout(shape, trainer_tp)
    flats = [torch.empty(n, dtype=torch.bfloat16, device=device) for n in layout.rank_numel]
    return TrainerShards(layout, flats)


def _mismatch(target: EngineLikeTarget, shards: TrainerShards, version: int) -> str:
    """Empty when every tensor's kept part equals version ``version``'s, else which differ."""
    wrong = []
    for recipe in shards.layout.recipes:
        name, full = recipe.spec.name, shards.assemble(recipe)
        kept = target.shard(name, tuple(full.shape)).of(full)
        if not torch.equal(target.resolve(name).view(torch.int16), kept.view(torch.int16)):
            wrong.append(name)
    return f"version {version}: {len(wrong)} tensor(s) differ, first {wrong[:3]}" if wrong else ""


def _publisher(
    shape, rank: int, world: int, devices: int, trainer_tp: int, address, timeout_s, commands, out
):
    from weightsync.sender import Publisher

    device = torch.device("cuda", rank % devices)
    torch.cuda.set_device(device)
    shards = _shards(shape, trainer_tp, device)
    regions, specs = shards.regions(rank % trainer_tp), shards.layout.specs
    with Publisher(address, publisher_id="node", rank=rank, world_size=world) as publisher:
        while (version := commands.get()) is not None:
            shards.fill(version)
            torch.cuda.synchronize(device)
            result = publisher.publish_packed(
                VersionManifest(version, specs),
                shards.pack,
                device=device,
                wait=True,
                timeout_s=timeout_s,
                regions=regions,
                direct=True,
            )
            out.put(("published", rank, result.status.SerializeToString()))


def _receiver(
    shape,
    rank: int,
    devices: int,
    tps: tuple[int, int],
    address: str,
    versions,
    reps,
    timeout_s,
    barrier,
    out,
):
    from weightsync.receiver.core import ReceiverCore

    trainer_tp, engine_tp = tps
    device = torch.device("cuda", rank % devices)
    torch.cuda.set_device(device)
    model = EngineLikeModel(shape, device, tp=engine_tp, rank=rank % engine_tp)
    target = EngineLikeTarget(model)
    expected = _shards(shape, trainer_tp, device)
    receiver = ReceiverCore(target, address, receiver_id=f"gpu{rank}")
    out.put(("ready", rank))
    for _ in range(versions):
        version = receiver.sync(timeout=timeout_s)
        expected.fill(version)
        out.put(("applied", rank, _mismatch(target, expected, version)))
    kept = sum(p.nbytes for p in model.parameters())
    share, source = (torch.empty(kept, dtype=torch.uint8, device=device) for _ in range(2))
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        barrier.wait()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        share.copy_(source)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peer = _peer_bytes_per_s(device, reps) if rank == 0 and devices > 1 else None
    out.put(("floor", rank, times[1:], kept, peer))
    receiver.close()


def _peer_bytes_per_s(device: torch.device, reps: int, nbytes: int = 2 << 30) -> float:
    """The best of torch's copy and :class:`~weightsync.peer_copies.PeerCopies` moving
    ``nbytes`` from the next GPU into ``device``, alone (median of ``reps``)."""
    from weightsync import peer_copies
    from weightsync.regions import CopyBatch

    peer = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
    src = torch.empty(nbytes, dtype=torch.uint8, device=peer)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ways = [lambda: dst.copy_(src, non_blocking=True)]
    if peer_copies.fits(dst, src):
        ways.append(CopyBatch.of([(dst, src)], reused=True).run)
    best = 0.0
    for copy in ways:
        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize(peer)
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            copy()
            torch.cuda.synchronize(peer)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        best = max(best, nbytes / statistics.median(times[1:]))
    return best


def _child(what: str, body, *args) -> None:
    """A process of the bench running ``body(*args)`` (``out`` last): its failure is reported
    at once, then raised; else the bench would wait out its timeout for reports never sent."""
    try:
        body(*args)
    except BaseException as e:
        args[-1].put(("failed", what, f"{type(e).__name__}: {e}"))
        raise


def _collect(out, counts: dict[str, int], timeout_s: float) -> dict[str, list[tuple]]:
    """The next reports of the processes: ``counts[kind]`` of each kind, in any order.

    Raises:
        WeightSyncError: a process failed (naming it and its error).
        SyncTimeoutError: no report came for ``timeout_s`` (naming the missing ones).
    """
    got: dict[str, list[tuple]] = {kind: [] for kind in counts}
    while any(len(got[k]) < n for k, n in counts.items()):
        try:
            item = out.get(timeout=timeout_s)
        except queue.Empty:
            missing = {
                k: sorted(r[1] for r in got[k]) for k, n in counts.items() if len(got[k]) < n
            }
            raise SyncTimeoutError(
                f"node bench: no report for {timeout_s:g} s; waiting for {counts}, "
                f"have only (kind: ranks) {missing} (--timeout-s)"
            ) from None
        if item[0] == "failed":
            raise WeightSyncError(f"node bench: the {item[1]} failed: {item[2]}")
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
    trainer_tp: int = 1,
    devices: int | None = None,
) -> NodeRun:
    """Run the node case on GPUs 0..``gpus``-1, a trainer of TP ``trainer_tp`` and engines of
    TP ``engine_tp``: ``warmup`` + ``versions`` versions, then ``reps`` floor repetitions.

    ``devices`` (default ``gpus``): the GPUs the ranks spread over, rank r on GPU r % devices.
    Fewer than ``gpus`` makes ranks share a GPU: every read is then local and the timing is
    no node's, but a one-GPU machine runs the many-rank paths (DP and TP publishers, engine
    TP ranks declaring their shards) on CUDA.

    Raises:
        ConfigError: fewer GPUs than ``devices``, or ``gpus`` not a multiple of either TP size.
    """
    from weightsync.sender import Sender
    from weightsync.v1 import weightsync_pb2 as pb

    devices = devices or gpus
    if not 1 <= devices <= torch.cuda.device_count():
        raise ConfigError(f"--gpus {devices}: this machine has {torch.cuda.device_count()} GPU(s)")
    if devices > gpus:
        raise ConfigError(f"{gpus} rank(s) of each kind cannot spread over {devices} GPUs")
    if engine_tp < 1 or gpus % engine_tp:
        raise ConfigError(f"--engine-tp {engine_tp}: --gpus {gpus} must be a multiple of it")
    if trainer_tp < 1 or gpus % trainer_tp:
        raise ConfigError(f"--trainer-tp {trainer_tp}: --gpus {gpus} must be a multiple of it")
    total = warmup + versions
    ctx = mp.get_context("spawn")
    out, barrier = ctx.Queue(), ctx.Barrier(gpus)
    commands = [ctx.Queue() for _ in range(gpus)]
    sock_dir = tempfile.mkdtemp(prefix="ws-node-", dir="/tmp")
    procs: list = []
    try:
        with Sender(f"unix:{sock_dir}/s.sock", ack_timeout_s=timeout_s) as sender:
            for r in range(gpus):
                tps = (trainer_tp, engine_tp)
                args = (
                    shape, r, devices, tps, sender.address, total, reps, timeout_s, barrier, out
                )  # fmt: skip
                what = f"receiver {r} on GPU {r % devices}"
                procs.append(ctx.Process(target=_child, args=(what, _receiver, *args), daemon=True))
                procs[-1].start()
            _collect(out, {"ready": gpus}, timeout_s)
            for r in range(gpus):
                args = (
                    shape, r, gpus, devices, trainer_tp, sender.address, timeout_s, commands[r], out
                )  # fmt: skip
                what = f"publisher rank {r} on GPU {r % devices}"
                procs.append(
                    ctx.Process(target=_child, args=(what, _publisher, *args), daemon=True)
                )
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
        trainer_tp,
        next((f[4] for f in floors if f[4]), None),
    )


def summary(run: NodeRun) -> str:
    """Two lines: the node's timing and the floor."""
    applied = statistics.median(run.applied_s)
    floor = statistics.median(run.floor_s)
    link = statistics.median(run.link_floor_s)
    return (
        f"node: trainer {run.layout}, engines TP={run.engine_tp} x "
        f"{run.gpus // run.engine_tp}, {run.nbytes / 1e9:.2f} GB, "
        f"{run.kept_nbytes / 1e9:.2f} GB kept per engine GPU, direct: applied "
        f"{applied * 1e3:.1f} ms (median of {len(run.applied_s)}), bit-exact {run.bit_exact}, "
        f"route bytes {run.route_bytes}\n"
        f"floor: every GPU copying its {run.kept_nbytes / 1e9:.2f} GB from its own memory at "
        f"once ({run.gpus} processes): {floor * 1e3:.2f} ms; applied / floor = "
        f"{applied / floor:.2f}x\n"
        f"interconnect floor: {link * 1e3:.2f} ms; applied / it = {applied / link:.2f}x"
    )
