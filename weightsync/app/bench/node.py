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
import statistics
import time
from dataclasses import dataclass, replace

import torch

from weightsync.app.bench import floors
from weightsync.app.bench.children import children, report, reporting, scratch_dir
from weightsync.app.bench.engine_like import EngineLikeModel, EngineLikeTarget
from weightsync.app.bench.layout import TrainerShards, plan_layout
from weightsync.app.bench.models import ModelShape, hf_specs
from weightsync.app.bench.report import FLOOR, NODE_FLOOR, NODE_LINK_FLOOR, WEIGHTSYNC, Row
from weightsync.app.bench.worker import sync
from weightsync.errors import ConfigError
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
    case: str = "direct"
    """The row's name: ``direct`` (the synthetic trainer) or :data:`~.report.MEGATRON`."""
    transport: str = "cuda_ipc"
    trainer_note: str = ""
    expert_parallel: int = 1
    """A megatron MoE trainer's EP size: its experts are split over the ranks, so its routes
    (and its interconnect floor) are not those of the synthetic trainer of the same TP."""
    busiest_peer_bytes: int | None = None
    """The most bytes one receiver reads from other GPUs (``ReceiverOutcome.direct_route_bytes``,
    the last version); None: ``route_bytes``' peer bytes spread evenly over the GPUs."""

    @property
    def layout(self) -> str:
        ep = f", EP={self.expert_parallel}" if self.expert_parallel > 1 else ""
        return f"TP={self.trainer_tp} x DP={self.gpus // self.trainer_tp}{ep}"

    def held_to(self, measured: NodeRun) -> NodeRun:
        """This run with the floors of ``measured`` (the synthetic run on the same GPUs):
        its own layout's routes then set its interconnect floor."""
        return replace(self, floor_s=measured.floor_s, peer_bytes_per_s=measured.peer_bytes_per_s)

    @property
    def link_floor_s(self) -> tuple[float, ...]:
        """Per repetition: the larger of the local floor and the peer bytes into the busiest
        GPU over the best peer bandwidth."""
        peer = self.busiest_peer_bytes
        if peer is None:
            peer = self.route_bytes.get("peer", 0) / self.gpus
        link = peer / self.peer_bytes_per_s if self.peer_bytes_per_s else 0.0
        return tuple(max(s, link) for s in self.floor_s)

    @property
    def _busiest(self) -> str:
        n = self.busiest_peer_bytes
        return f", {n / 1e9:.2f} GB into the busiest GPU" if n else ""

    def rows(self) -> list[Row]:
        placement = node_placement(self.gpus, self.engine_tp, self.transport == "shm")
        # Route bytes count what each receiver keeps: a TP rank declares its shard.
        routes = ", ".join(f"{k} {n / 1e9:.1f} GB" for k, n in self.route_bytes.items() if n)
        bw = self.peer_bytes_per_s
        floors = [
            Row(FLOOR, NODE_FLOOR, "-", self.layout, placement, self.kept_nbytes, self.floor_s),
            Row(
                FLOOR,
                NODE_LINK_FLOOR,
                "-",
                self.layout,
                placement,
                self.kept_nbytes,
                self.link_floor_s,
                note=f"peer {bw / 1e9:.0f} GB/s{self._busiest}" if bw else "no peer route measured",
            ),
        ]
        return (floors if self.floor_s else []) + [
            Row(
                WEIGHTSYNC,
                self.case,
                self.transport,
                self.layout,
                placement,
                self.kept_nbytes,
                self.applied_s,
                bit_exact=self.bit_exact,
                note=f"{self.trainer_note}engines TP={self.engine_tp} x "
                f"{self.gpus // self.engine_tp}; routes: {routes}",
                failed=not self.bit_exact,
            ),
        ]


def node_placement(gpus: int, engine_tp: int = 1, cpu: bool = False) -> str:
    """The receivers' placement in the report: one per GPU of ``gpus`` (or CPU process)."""
    where = f"node: {gpus} {'CPU processes' if cpu else 'GPUs'}"
    return where + (f", engines TP={engine_tp}" if engine_tp > 1 else "")


def _shards(shape: ModelShape, trainer_tp: int, device: torch.device) -> TrainerShards:
    """Every TP rank's flat buffer of a TP=``trainer_tp`` trainer, on ``device``: a publisher
    offers its own rank's, a receiver assembles the expected tensors from all of them."""
    layout = plan_layout(shape, trainer_tp)
    flats = [torch.empty(n, dtype=torch.bfloat16, device=device) for n in layout.rank_numel]
    return TrainerShards(layout, flats)


@dataclass(frozen=True)
class SyntheticTrainer:
    """The node case's trainer: TP ``tp`` x DP, :mod:`.layout`'s flat buffer per rank."""

    tp: int = 1
    ep = 1
    case = "direct"
    note = ""

    def publish(self, shape, rank, world, device, address, timeout_s, commands, out) -> None:
        """Rank ``rank`` of ``world``: publish each version ``commands`` gives until None."""
        from weightsync.sender import Publisher

        shards = _shards(shape, self.tp, device)
        regions, specs = shards.regions(rank % self.tp), shards.layout.specs
        with Publisher(address, publisher_id="node", rank=rank, world_size=world) as publisher:
            while (version := commands.get()) is not None:
                shards.fill(version)
                sync(device)
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

    def check(self, shape: ModelShape, device: torch.device):
        """A receiver's check of each version: ``(target, version) -> ""`` or what differs."""
        shards = _shards(shape, self.tp, device)
        recipes = {r.spec.name: r for r in shards.layout.recipes}

        def check(target: EngineLikeTarget, version: int) -> str:
            shards.fill(version)
            return target.mismatch(recipes, lambda name: shards.assemble(recipes[name]), version)

        return check


def _device(rank: int, devices: int) -> torch.device:
    """Rank ``rank``'s device: GPU ``rank % devices``, or the CPU when ``devices`` is 0."""
    if not devices:
        return torch.device("cpu")
    device = torch.device("cuda", rank % devices)
    torch.cuda.set_device(device)
    return device


def _publisher(trainer, shape, rank: int, world: int, devices: int, *args) -> None:
    trainer.publish(shape, rank, world, _device(rank, devices), *args)


def _receiver(
    trainer,
    shape,
    rank: int,
    devices: int,
    engine_tp: int,
    address: str,
    versions,
    reps,
    timeout_s,
    barrier,
    out,
):
    from weightsync.receiver.core import ReceiverCore

    device = _device(rank, devices)
    model = EngineLikeModel(shape, device, tp=engine_tp, rank=rank % engine_tp)
    target = EngineLikeTarget(model)
    check = trainer.check(shape, device)
    receiver = ReceiverCore(target, address, receiver_id=f"gpu{rank}")
    out.put(("ready", rank))
    for _ in range(versions):
        version = receiver.sync(timeout=timeout_s)
        out.put(("applied", rank, check(target, version)))
    kept = sum(p.nbytes for p in model.parameters())
    times = []
    if reps:  # the floor: every GPU copying its share at once
        share, source = (torch.empty(kept, dtype=torch.uint8, device=device) for _ in range(2))
        for _ in range(reps + 1):  # the first is a warm-up
            barrier.wait()
            sync(device)
            start = time.perf_counter()
            share.copy_(source)
            sync(device)
            times.append(time.perf_counter() - start)
        # Rank 0's peer copy below takes 2 GB on GPU 1 too: with every rank's two floor buffers
        # still held there, the MoE rows with a megatron trainer ran out of memory on 80 GB H100s.
        del share, source
        if device.type == "cuda":
            torch.cuda.empty_cache()
        barrier.wait()
    peer = floors.peer_bytes_per_s(device, reps) if rank == 0 and devices > 1 and reps else None
    out.put(("floor", rank, times[1:], kept, peer))
    receiver.close()


def _collect(out, procs, counts: dict[str, int], timeout_s: float) -> dict[str, list[tuple]]:
    """The next reports of the processes ``procs``: ``counts[kind]`` of each kind, in any order.

    Raises:
        WeightSyncError: a process failed or died (naming it).
        SyncTimeoutError: no report came for ``timeout_s`` (naming the missing ones).
    """
    got: dict[str, list[tuple]] = {kind: [] for kind in counts}
    while any(len(got[k]) < n for k, n in counts.items()):
        have = {k: sorted(r[1] for r in got[k]) for k, n in counts.items() if len(got[k]) < n}
        what = f"node bench, waiting for {counts}, have only (kind: ranks) {have}"
        item = report(out, procs, timeout_s, what)
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
    trainer=None,
) -> NodeRun:
    """Run the node case on GPUs 0..``gpus``-1, a trainer of TP ``trainer_tp`` and engines of
    TP ``engine_tp``: ``warmup`` + ``versions`` versions, then ``reps`` floor repetitions.

    ``devices`` (default ``gpus``): the GPUs the ranks spread over, rank r on GPU r % devices.
    Fewer than ``gpus`` makes ranks share a GPU: every read is then local and the timing is
    no node's, but a one-GPU machine runs the many-rank paths (DP and TP publishers, engine
    TP ranks declaring their shards) on CUDA. 0: every rank on the CPU (shm staging, no
    direct reads; the process logic, not a node's timing). ``trainer`` (default: the
    synthetic one of TP ``trainer_tp``): what the publisher ranks hold and how receivers
    check it (:class:`SyntheticTrainer`, or :class:`~.megatron_node.MegatronTrainer`).

    Raises:
        ConfigError: fewer GPUs than ``devices``, or ``gpus`` not a multiple of either TP size.
    """
    from weightsync.sender import Sender
    from weightsync.v1 import weightsync_pb2 as pb

    trainer = trainer or SyntheticTrainer(trainer_tp)
    devices = gpus if devices is None else devices
    if devices and not devices <= torch.cuda.device_count():
        raise ConfigError(f"--gpus {devices}: this machine has {torch.cuda.device_count()} GPU(s)")
    if devices > gpus or gpus < 1:
        raise ConfigError(f"{gpus} rank(s) of each kind cannot spread over {devices} GPUs")
    if engine_tp < 1 or gpus % engine_tp:
        raise ConfigError(f"--engine-tp {engine_tp}: --gpus {gpus} must be a multiple of it")
    if trainer.tp < 1 or gpus % trainer.tp:
        raise ConfigError(f"--trainer-tp {trainer.tp}: --gpus {gpus} must be a multiple of it")
    total = warmup + versions
    ctx = mp.get_context("spawn")
    out, barrier = ctx.Queue(), ctx.Barrier(gpus)
    commands = [ctx.Queue() for _ in range(gpus)]

    def start(what: str, body, *args) -> None:
        where = f"GPU {args[2] % devices}" if devices else "the CPU"
        what = f"{what} {args[2]} on {where}"
        procs.append(ctx.Process(target=reporting, args=(what, body, *args), daemon=True))
        procs[-1].start()

    with scratch_dir("ws-node-") as sock_dir:
        with (
            Sender(f"unix:{sock_dir}/s.sock", ack_timeout_s=timeout_s) as sender,
            children() as procs,
        ):
            for r in range(gpus):
                start(
                    "receiver", _receiver, trainer, shape, r, devices, engine_tp, sender.address,
                    total, reps, timeout_s, barrier, out,
                )  # fmt: skip
            _collect(out, procs, {"ready": gpus}, timeout_s)
            for r in range(gpus):
                start(
                    "publisher rank", _publisher, trainer, shape, r, gpus, devices,
                    sender.address, timeout_s, commands[r], out,
                )  # fmt: skip
            statuses, exact = [], True
            for version in range(1, total + 1):
                for q in commands:
                    q.put(version)
                # After the last version, receivers report their floors (at once without reps).
                kinds = {"published": gpus, "applied": gpus, "floor": gpus * (version == total)}
                got = _collect(out, procs, kinds, timeout_s)
                statuses.append(pb.VersionStatus.FromString(got["published"][0][2]))
                wrong = [f"gpu{rank} {why}" for _, rank, why in got["applied"] if why]
                exact = exact and not wrong
                for line in wrong:
                    print(f"node bench: NOT bit-exact: {line}", flush=True)
            floors = got["floor"]
            for q in commands:
                q.put(None)
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
        trainer.tp,
        next((f[4] for f in floors if f[4]), None),
        trainer.case,
        "cuda_ipc" if devices else "shm",
        trainer.note,
        trainer.ep,
        max((o.direct_route_bytes.get("peer", 0) for o in measured[-1].receivers), default=None),
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
