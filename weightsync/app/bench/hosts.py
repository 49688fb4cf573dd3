"""The hosts case of ``weightsync bench --hosts`` (issue 12): a trainer spanning two hosts.

The devices of this machine play two hosts, told apart by ``WEIGHTSYNC_HOST_ID``: the first
half of the engines is host a, the rest host b (GPUs 0..N/2-1 and N/2..N-1; on CPU N receiver
processes). Trainer PP=2: the publisher process on each host's first device holds its
pipeline stage's HF tensors (layers 0..L/2-1 with the embedding; the rest with the final norm
and ``lm_head``), the split :func:`~weightsync.parts.plan_parts` makes. Engines TP=1: a
receiver process per device. Measured in one run:

- **two senders**: a sender process per host, both sending their stage's part at once; every
  receiver is registered with both, maps its own host's part and gets the other's by
  broadcast (NCCL on CUDA, gloo on CPU): each sender broadcasts its part once, to a group of
  the other host's receivers (each sender's Status says every receiver's data path);
- **one sender**: host a's sender sends every tensor from one publisher holding the whole
  model on host a's first device; host b's receivers get all of it by broadcast;
- the floors beside them: one broadcast of the model's bytes, and of the larger part's (the
  issue 32 target's), between two devices (``floors.broadcast``, two processes). On one
  machine the "hosts" share NVLink, not NICs: a host's second GPU takes its own host's part
  from the first over the same links as the other host's part, which real hosts' NICs do not.

A version's time: from the first part's start to the last part's end (every receiver
applied it), by the senders' clocks (``started_at_unix_s + complete_s`` of each part; one
machine, one clock); the median over the measured versions. Bit-exact: every receiver checks
every tensor after every version.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
from dataclasses import dataclass

import torch

from weightsync.app.bench import floors
from weightsync.app.bench.children import children, expect, report, scratch_dir
from weightsync.app.bench.engine_like import EngineLikeModel, EngineLikeTarget
from weightsync.app.bench.models import ModelShape, hf_specs
from weightsync.app.bench.report import FLOOR, HOSTS_FLOOR, WEIGHTSYNC, Row
from weightsync.buckets import TensorSpec
from weightsync.errors import ConfigError

HOSTS = ("bench-host-a", "bench-host-b")
WHAT = "hosts bench"


@dataclass(frozen=True)
class HostsRun:
    """One hosts measurement: both cases."""

    devices: tuple[str, ...]
    nbytes: int
    two_senders_s: tuple[float, ...]
    one_sender_s: tuple[float, ...]
    part_bytes: tuple[int, int]
    bit_exact: bool
    broadcast_s: tuple[float, ...]
    """One broadcast of ``nbytes`` between two devices, per repetition."""
    transport: str
    engine_tp: int = 1
    broadcast_bytes: tuple[int, int] = (0, 0)
    """Bytes the senders broadcast in the last version, once per group and bucket
    (``VersionStatus.broadcast_bytes`` summed over the parts; two senders, one sender)."""
    received_bytes: tuple[int, int] = (0, 0)
    """Bytes the receivers took by broadcast in the last version, each receiver counted
    (``route_bytes["broadcast"]``; two senders, one sender)."""
    paths: tuple[dict[str, dict[str, str]], ...] = ()
    """Per case (two senders, one sender): each sender host's Status, receiver id -> data
    path ("map" or "broadcast")."""
    part_broadcast_s: tuple[float, ...] = ()
    """One broadcast of the larger part between two devices: issue 32's floor for two
    senders."""

    def rows(self) -> list[Row]:
        layout = "PP=2 over 2 hosts"
        placement = f"2 hosts: {len(self.devices)} engines" + (
            f" TP={self.engine_tp}" if self.engine_tp > 1 else ""
        )
        (wire_two, wire_one), (into_two, into_one) = self.broadcast_bytes, self.received_bytes
        a, b = (n / 1e9 for n in self.part_bytes)
        transport = self.transport
        part = max(self.part_bytes)
        return [
            Row(FLOOR, HOSTS_FLOOR, transport, layout, placement, self.nbytes, self.broadcast_s),
            Row(
                FLOOR,
                f"{HOSTS_FLOOR} of a part",
                transport,
                layout,
                placement,
                part,
                self.part_broadcast_s,
            ),
            Row(
                WEIGHTSYNC,
                "two senders",
                transport,
                layout,
                placement,
                self.nbytes,
                self.two_senders_s,
                bit_exact=self.bit_exact,
                note=f"a sender per host, at once: parts {a:.2f} + {b:.2f} GB; "
                f"{_ratio(self.two_senders_s, self.part_broadcast_s)} one broadcast of a part; "
                f"{wire_two:,} bytes broadcast, {into_two:,} received",
                failed=not self.bit_exact,
            ),
            Row(
                WEIGHTSYNC,
                "one sender",
                transport,
                layout,
                placement,
                self.nbytes,
                self.one_sender_s,
                bit_exact=self.bit_exact,
                note=f"host a's sender sends everything; {wire_one:,} bytes broadcast, "
                f"{into_one:,} received",
                failed=not self.bit_exact,
            ),
        ]


def _ratio(times: tuple[float, ...], floor: tuple[float, ...]) -> str:
    if not times or not floor:
        return "-"
    return f"{statistics.median(times) / statistics.median(floor):.2f}x"


def stage_of(name: str, layers: int) -> int:
    """The pipeline stage (0 or 1) holding HF tensor ``name`` under PP=2."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) >= layers // 2
    return 0 if name.startswith("model.embed_tokens") else 1


def _tensors(specs: tuple[TensorSpec, ...], device: torch.device) -> dict[str, torch.Tensor]:
    return {s.name: torch.empty(s.shape, dtype=s.torch_dtype, device=device) for s in specs}


def _fill(tensors: dict[str, torch.Tensor], order: dict[str, int], version: int) -> None:
    """Version ``version``'s bytes of each tensor, the same wherever it is filled."""
    for name, t in tensors.items():
        fill_version(t, order[name], version)


def fill_version(t: torch.Tensor, index: int, version: int) -> None:
    """Version ``version``'s bytes of the ``index``-th HF tensor (contiguous ``t``): the same on
    any device of one type, so a receiver computes what a publisher filled."""
    seed = version * 1_000_003 + index
    t.view(torch.uint8).random_(0, 256, generator=torch.Generator(t.device).manual_seed(seed))


def _sender_main(host: str, address: str, timeout_s: float, stop) -> None:
    os.environ["WEIGHTSYNC_HOST_ID"] = host
    from weightsync.sender import Sender

    with Sender(address, ack_timeout_s=timeout_s):
        stop.get()


def _as_host(host: str, device_name: str, shape: ModelShape):
    """A process of ``host`` on ``device_name``: its device, every HF spec and their order."""
    os.environ["WEIGHTSYNC_HOST_ID"] = host
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    specs = hf_specs(shape)
    return device, specs, {s.name: i for i, s in enumerate(specs)}


def _offered(specs: tuple[TensorSpec, ...], device: torch.device):
    """The publisher's tensors where its sender can map them: CUDA memory, or on CPU views of
    one shm buffer it allocated (then the sender packs, and can slice, as on CUDA). Returns
    the tensors and the shm buffer to release (None on CUDA)."""
    if device.type == "cuda":
        return _tensors(specs, device), None
    from weightsync.transports import shm_tensors

    store, tensors = shm_tensors(specs)
    return tensors, store


def _publisher_main(shape, device_name, host, address, names, part, timeout_s, commands, out):
    from weightsync.transports import get_transport

    device, specs, order = _as_host(host, device_name, shape)
    tensors, store = _offered(tuple(s for s in specs if s.name in names), device)
    try:
        _publish(tensors, order, device, host, address, part, timeout_s, commands, out)
    finally:
        if store is not None:
            get_transport("shm").release(store)


def _publish(tensors, order, device, host, address, part, timeout_s, commands, out) -> None:
    from weightsync.sender import Publisher

    with Publisher(address, publisher_id=f"stage-{host}") as publisher:
        while (version := commands.get()) is not None:
            _fill(tensors, order, version)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            result = publisher.publish(tensors, version, wait=True, timeout_s=timeout_s, part=part)
            s = result.status
            crossed = (s.broadcast_bytes, s.route_bytes["broadcast"])
            out.put(("published", host, s.started_at_unix_s, s.complete_s, crossed))
        paths = {r.receiver_id: r.data_path for r in publisher.status().receivers}
        out.put(("paths", host, paths))


def _receiver_main(
    shape, device_name, host, index, engine_tp, addresses, versions, timeout_s, out
) -> None:
    from weightsync.receiver.core import ReceiverCore

    device, specs, order = _as_host(host, device_name, shape)
    rank = index % engine_tp
    target = EngineLikeTarget(EngineLikeModel(shape, device, tp=engine_tp, rank=rank))
    expected = _tensors(specs, device)
    receiver = ReceiverCore(target, addresses, receiver_id=f"{host}-{index}-{device_name}")
    out.put(("ready", device_name))
    for _ in range(versions):
        version = receiver.sync(timeout=timeout_s)
        _fill(expected, order, version)
        wrong = [
            n
            for n, t in expected.items()
            if not torch.equal(
                target.resolve(n).view(torch.uint8),
                target.shard(n, tuple(t.shape)).of(t).view(torch.uint8),
            )
        ]
        out.put(("applied", device_name, f"version {version}: {wrong[:3]}" if wrong else ""))
    receiver.close()


def _measure(shape, devices, publishers, receiver_addresses, total, timeout_s, socks, engine_tp):
    """One case: ``publishers`` = (device, host, address, names, part) each; returns each
    version's time, whether every receiver was bit-exact every time, the bytes broadcast and
    received in the last version, and each sender host's receivers' data paths."""
    ctx = mp.get_context("spawn")
    out, senders = ctx.Queue(), []
    half = len(devices) // 2
    try:
        with children() as procs:
            for host, address in socks.items():
                stop = ctx.Queue()
                proc = ctx.Process(target=_sender_main, args=(host, address, timeout_s, stop))
                proc.start()
                senders.append((proc, stop))
            for i, device in enumerate(devices):
                host = HOSTS[i >= half]
                args = (
                    shape, device, host, i, engine_tp, receiver_addresses, total, timeout_s, out
                )  # fmt: skip
                procs.append(ctx.Process(target=_receiver_main, args=args, daemon=True))
                procs[-1].start()
            expect(out, procs, "ready", len(devices), timeout_s, WHAT)
            commands = []
            for device, host, address, names, part in publishers:
                q = ctx.Queue()
                args = (shape, device, host, address, names, part, timeout_s, q, out)
                procs.append(ctx.Process(target=_publisher_main, args=args, daemon=True))
                procs[-1].start()
                commands.append(q)
            times, exact, crossed = [], True, (0, 0)
            for version in range(1, total + 1):
                for q in commands:
                    q.put(version)
                # Receivers may report before the publishers' waits return: any order.
                got = [
                    report(out, procs, timeout_s, WHAT)
                    for _ in range(len(publishers) + len(devices))
                ]
                parts = [g for g in got if g[0] == "published"]
                if len(parts) != len(publishers):
                    raise RuntimeError(f"hosts bench: version {version}: reports {got}")
                times.append(max(g[2] + g[3] for g in parts) - min(g[2] for g in parts))
                crossed = tuple(sum(g[4][k] for g in parts) for k in (0, 1))
                wrong = [f"{g[1]} {g[2]}" for g in got if g[0] == "applied" and g[2]]
                for line in wrong:
                    print(f"hosts bench: NOT bit-exact: {line}", flush=True)
                exact = exact and not wrong
            for q in commands:
                q.put(None)
            paths = {
                g[1]: g[2] for g in expect(out, procs, "paths", len(publishers), timeout_s, WHAT)
            }
    finally:
        for proc, stop in senders:
            stop.put(None)
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
    return times, exact, crossed, paths


def measure_hosts(
    shape: ModelShape,
    gpus: int,
    versions: int,
    warmup: int,
    timeout_s: float,
    engine_tp: int = 1,
    cpu_engines: int = 2,
) -> HostsRun:
    """Both cases on GPUs 0..``gpus``-1 as two hosts (``gpus`` = 0: on CPU, ``cpu_engines``
    receiver processes); ``warmup`` + ``versions`` versions each. Engines TP=``engine_tp``:
    engine i is TP rank i % ``engine_tp`` and declares its shard, so from the second version on
    each sender broadcasts it only that (where the sender packs: CUDA, and CPU publishers
    offering shm).

    Raises:
        ConfigError: an odd number of engines, or more GPUs than this machine has.
    """
    from weightsync.parts import plan_parts

    have = torch.cuda.device_count() if gpus else cpu_engines
    engines = gpus or cpu_engines
    if engines < 2 or engines % 2 or engines > have:
        raise ConfigError(
            f"--hosts needs an even number of engines >= 2 (this machine has "
            f"{torch.cuda.device_count()} GPUs); got {engines}"
        )
    devices = tuple(f"cuda:{i}" if gpus else "cpu" for i in range(engines))
    specs = hf_specs(shape)
    plan = plan_parts(specs, {s.name: [{HOSTS[stage_of(s.name, shape.layers)]}] for s in specs})
    first = {HOSTS[0]: devices[0], HOSTS[1]: devices[len(devices) // 2]}
    total = warmup + versions
    with scratch_dir("ws-hosts-") as sock_dir:
        socks = {h: f"unix:{sock_dir}/{h}.sock" for h in HOSTS}
        two = [
            (first[h], h, socks[h], {s.name for s in plan.tensors_of(h)}, plan.part_of(h))
            for h in HOSTS
        ]
        two_s, exact_two, crossed_two, paths_two = _measure(
            shape, devices, two, list(socks.values()), total, timeout_s, socks, engine_tp
        )
        one = [(first[HOSTS[0]], HOSTS[0], socks[HOSTS[0]], {s.name for s in specs}, None)]
        one_socks = {HOSTS[0]: socks[HOSTS[0]]}
        one_s, exact_one, crossed_one, paths_one = _measure(
            shape, devices, one, [socks[HOSTS[0]]], total, timeout_s, one_socks, engine_tp
        )
        broadcast_s, backend = floors.broadcast(sum(s.nbytes for s in specs), versions, timeout_s)
        part = max(plan.bytes_of(h) for h in HOSTS)
        part_s, _ = floors.broadcast(part, versions, timeout_s)
    return HostsRun(
        devices,
        sum(s.nbytes for s in specs),
        tuple(two_s[warmup:]),
        tuple(one_s[warmup:]),
        (plan.bytes_of(HOSTS[0]), plan.bytes_of(HOSTS[1])),
        exact_two and exact_one,
        tuple(broadcast_s),
        "cuda_ipc + nccl" if backend == "nccl" else "shm + gloo",
        engine_tp,
        (crossed_two[0], crossed_one[0]),
        (crossed_two[1], crossed_one[1]),
        (paths_two, paths_one),
        tuple(part_s),
    )


def summary(run: HostsRun) -> str:
    two, one = statistics.median(run.two_senders_s), statistics.median(run.one_sender_s)
    floor = statistics.median(run.broadcast_s)
    part = statistics.median(run.part_broadcast_s)
    return (
        f"hosts: {run.nbytes / 1e9:.2f} GB into {len(run.devices)} engines on 2 hosts: two "
        f"senders at once {two * 1e3:.1f} ms, one sender {one * 1e3:.1f} ms "
        f"({one / two:.2f}x), one broadcast of the same bytes {floor * 1e3:.1f} ms, of the "
        f"larger part {part * 1e3:.1f} ms (two senders {two / part:.2f}x it; issue 32's "
        f"target 1.3x); broadcast in the last version (sent once per group / received): "
        f"{run.broadcast_bytes[0]} / {run.received_bytes[0]} (two senders), "
        f"{run.broadcast_bytes[1]} / {run.received_bytes[1]} (one); data paths "
        f"{run.paths[0] if run.paths else '-'}; engines TP={run.engine_tp}; "
        f"bit-exact: {'yes' if run.bit_exact else 'NO'}"
    )
