"""The NCCL fan-out case of ``weightsync bench --fanout N`` (issue 32): one trainer GPU, a
receiver on every GPU.

The trainer (this process) holds the whole model on GPU 0 (TP=1, HF tensors as views of one
flat buffer) and publishes to a ``Sender(transport="nccl")`` embedded here, with
``publish(wait=True)``; a ``TorchReceiver`` process on each of GPUs 0..N-1 holds a plain
module of the same tensors. The receiver on GPU 0 maps the staging buffers (NCCL cannot put
two ranks on one GPU); the others get every bucket by broadcast. The floor, in the same run:
one NCCL broadcast of the same bytes as one buffer from GPU 0 to GPUs 1..N-1
(``floors.broadcast``), the slowest rank per repetition.

Timing: the trainer's wall time of each ``publish(wait=True)`` (start -> every receiver
applied), median over the measured versions. Every version is checked bit for bit on every
receiver (each fills the expected bytes on its own GPU from the version's seed, as the
trainer did) before the next is published, so the check is not timed.

Run alone: ``python -m weightsync.app.bench.fanout --gpus 2`` (prints one JSON line);
``--no-local-receiver`` leaves GPU 0 without a receiver: what the one on GPU 0 costs the others
(its copies and the sender's pack and broadcast are two processes' kernels on one GPU, which
take turns).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from weightsync.app.arguments import bench_alone_parser
from weightsync.app.bench.children import children, expect, reporting, scratch_dir
from weightsync.app.bench.models import ModelShape, hf_specs, model_shape
from weightsync.errors import ConfigError

ALIGN = 256
WHAT = "fan-out bench"


@dataclass(frozen=True)
class FanoutRun:
    """One fan-out measurement."""

    receivers: int
    nbytes: int
    publish_s: tuple[float, ...]
    """Each measured version's ``publish(wait=True)`` wall time."""
    broadcast_s: tuple[float, ...]
    """Each repetition of one broadcast of ``nbytes`` from GPU 0 to GPUs 1..N-1 (empty when
    not measured)."""
    bit_exact: bool
    complete_s: tuple[float, ...] = ()
    """The sender's ``complete_s`` of each measured version."""
    route_bytes: dict[str, int] | None = None
    """The last version's bytes by route, all receivers together."""
    local_receiver: bool = True
    """Whether a receiver sat on GPU 0 beside the trainer (else only on the other GPUs)."""

    @property
    def seconds(self) -> float:
        return statistics.median(self.publish_s)

    @property
    def floor_s(self) -> float | None:
        return statistics.median(self.broadcast_s) if self.broadcast_s else None

    @property
    def ratio(self) -> float | None:
        """Median publish over median broadcast (None without a floor)."""
        floor = self.floor_s
        return self.seconds / floor if floor else None

    def rows(self) -> list:
        from weightsync.app.bench.report import FLOOR, HOSTS_FLOOR, WEIGHTSYNC, Row

        placement = fanout_placement(self.receivers, self.local_receiver)
        routes = ", ".join(
            f"{k} {n / 1e9:.1f} GB" for k, n in (self.route_bytes or {}).items() if n
        )
        rows = []
        if self.broadcast_s:
            rows.append(
                Row(
                    FLOOR,
                    HOSTS_FLOOR,
                    "nccl",
                    "one buffer",
                    placement,
                    self.nbytes,
                    self.broadcast_s,
                )
            )
        rows.append(
            Row(
                WEIGHTSYNC,
                "nccl fan-out",
                "nccl",
                "TP=1",
                placement,
                self.nbytes,
                self.publish_s,
                bit_exact=self.bit_exact,
                note=f"routes: {routes}" if routes else "",
                failed=not self.bit_exact,
            )
        )
        return rows


def fanout_placement(receivers: int, local_receiver: bool = True) -> str:
    """The receivers' placement in the report: one per GPU, the trainer on GPU 0."""
    if local_receiver:
        return f"fan-out: GPU 0 -> {receivers} GPUs"
    return f"fan-out: GPU 0 -> {receivers} other GPU(s)"


def _offsets(specs) -> tuple[list[int], int]:
    """Each tensor's byte offset in the flat buffer (aligned), and the buffer's size."""
    offsets, at = [], 0
    for spec in specs:
        offsets.append(at)
        at += -(-spec.nbytes // ALIGN) * ALIGN
    return offsets, at


def _views(flat: torch.Tensor, specs, offsets: Sequence[int]) -> dict[str, torch.Tensor]:
    return {
        s.name: flat[o : o + s.nbytes].view(s.torch_dtype).view(s.shape)
        for s, o in zip(specs, offsets, strict=True)
    }


def _fill(flat: torch.Tensor, version: int) -> None:
    """Random bytes, the same for the same version on any GPU of one kind."""
    g = torch.Generator(flat.device).manual_seed(version)
    flat.random_(0, 256, generator=g)


def _module(specs, device: torch.device, flat: bool = False) -> torch.nn.Module:
    """A plain module whose ``state_dict`` names are the HF names. ``flat``: its parameters are
    views of one buffer, as an engine keeps a layer's experts in a few fused tensors (so the
    sender can write them in place however many tensors there are)."""
    root = torch.nn.Module()
    if flat:
        offsets, total = _offsets(specs)
        views = _views(torch.empty(total, dtype=torch.uint8, device=device), specs, offsets)
    for spec in specs:
        *path, leaf = spec.name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        if flat:
            data = views[spec.name]
        else:
            data = torch.empty(spec.shape, dtype=spec.torch_dtype, device=device)
        mod.register_parameter(leaf, torch.nn.Parameter(data, requires_grad=False))
    return root


def _receiver(shape: ModelShape, rank: int, address: str, versions: int, timeout_s, out) -> None:
    from weightsync.receiver.torch_receiver import TorchReceiver

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    specs = hf_specs(shape)
    model = _module(specs, device)
    live = dict(model.state_dict())
    offsets, total = _offsets(specs)
    expected = torch.empty(total, dtype=torch.uint8, device=device)
    want = _views(expected, specs, offsets)
    receiver = TorchReceiver(model, address, receiver_id=f"fan{rank}")
    out.put(("ready", rank))
    try:
        for _ in range(versions):
            version = receiver.sync(timeout=timeout_s)
            _fill(expected, version)
            wrong = [
                n
                for n, t in want.items()
                if not torch.equal(
                    live[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
                )
            ]
            why = (
                f"version {version}: {len(wrong)} tensor(s) differ, first {wrong[:3]}"
                if wrong
                else ""
            )
            out.put(("applied", rank, why))
    finally:
        receiver.close()


def measure_fanout(
    shape: ModelShape,
    gpus: int,
    versions: int,
    warmup: int,
    timeout_s: float,
    bucket_size_bytes: int | None = None,
    floor_reps: int | None = None,
    flat: bool = False,
    local_receiver: bool = True,
    **sender_settings,
) -> FanoutRun:
    """Publish ``warmup`` + ``versions`` versions from GPU 0 to a receiver on each of GPUs
    0..``gpus``-1 over ``Sender(transport="nccl")``; first the floor, ``floor_reps``
    broadcasts (default ``versions``; 0: none) of the same bytes from GPU 0 to the others.
    The trainer's tensors are allocated one by one, as a model's parameters are, or (``flat``)
    as views of one buffer, as Megatron keeps them. Without ``local_receiver`` GPU 0 has no
    receiver (GPUs 1..``gpus``-1 have one each). ``sender_settings`` go to the sender.

    Raises:
        ConfigError: fewer than 2 GPUs asked for, or more than the machine has.
    """
    from weightsync.app.bench.floors import broadcast
    from weightsync.sender import Publisher, Sender

    if not 2 <= gpus <= torch.cuda.device_count():
        raise ConfigError(
            f"--fanout {gpus}: needs 2 or more GPUs, this machine has {torch.cuda.device_count()}"
        )
    specs = hf_specs(shape)
    nbytes = sum(s.nbytes for s in specs)
    reps = versions if floor_reps is None else floor_reps
    floor = tuple(broadcast(nbytes, reps, timeout_s, ranks=gpus)[0]) if reps else ()
    device = torch.device("cuda", 0)
    offsets, total = _offsets(specs)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    views = _views(buffer, specs, offsets)
    if not flat:  # separate storages, filled from the buffer every version
        views = {n: torch.empty_like(v) for n, v in views.items()}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    settings = dict(sender_settings)
    if bucket_size_bytes is not None:
        settings["bucket_size_bytes"] = bucket_size_bytes
    samples, statuses, wrong = [], [], []
    with scratch_dir("ws-fanout-") as sock_dir:
        with (
            Sender(
                f"unix:{sock_dir}/s.sock", transport="nccl", ack_timeout_s=timeout_s, **settings
            ) as sender,
            children() as procs,
        ):
            ranks = range(0 if local_receiver else 1, gpus)
            for r in ranks:
                args = (shape, r, sender.address, warmup + versions, timeout_s, out)
                procs.append(
                    ctx.Process(target=reporting, args=(f"receiver on GPU {r}", _receiver, *args))
                )
                procs[-1].start()
            expect(out, procs, "ready", len(ranks), timeout_s, WHAT)
            with Publisher(sender.address) as publisher:
                for version in range(1, warmup + versions + 1):
                    _fill(buffer, version)
                    if not flat:
                        for view, o in zip(views.values(), offsets, strict=True):
                            view.view(-1).view(torch.uint8).copy_(buffer[o : o + view.nbytes])
                    torch.cuda.synchronize(device)
                    start = time.perf_counter()
                    result = publisher.publish(views, version, wait=True, timeout_s=timeout_s)
                    samples.append(time.perf_counter() - start)
                    statuses.append(result.status)
                    got = expect(out, procs, "applied", len(ranks), timeout_s, WHAT)
                    wrong += [why for _, _, why in got if why]
    for line in wrong:
        print(f"fan-out bench: NOT bit-exact: {line}", flush=True)
    last = statuses[-1]
    return FanoutRun(
        len(ranks),
        nbytes,
        tuple(samples[warmup:]),
        floor,
        not wrong,
        tuple(s.complete_s for s in statuses[warmup:] if s is not None),
        dict(last.route_bytes) if last is not None and hasattr(last, "route_bytes") else None,
        local_receiver,
    )


def summary(run: FanoutRun) -> str:
    """One line: the fan-out's timing against one broadcast."""
    floor = run.floor_s
    against = (
        f"; one broadcast of the same bytes {floor * 1e3:.1f} ms: {run.ratio:.2f}x" if floor else ""
    )
    placement = fanout_placement(run.receivers, run.local_receiver)
    return (
        f"nccl {placement}, {run.nbytes / 1e9:.2f} GB: publish "
        f"{run.seconds * 1e3:.1f} ms (median of {len(run.publish_s)}){against}, bit-exact "
        f"{run.bit_exact}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = bench_alone_parser(__doc__)
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--versions", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--floor-reps", type=int, default=None)
    p.add_argument("--bucket-size-mb", type=int, default=None)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--flat", action="store_true", help="trainer tensors as views of one buffer")
    p.add_argument("--num-buffers", type=int, default=None, help="the sender's staging slots")
    p.add_argument(
        "--no-local-receiver",
        dest="local_receiver",
        action="store_false",
        help="no receiver on GPU 0 (the trainer's): GPUs 1..N-1 only",
    )
    args = p.parse_args(argv)
    extra = {} if args.num_buffers is None else {"num_buffers": args.num_buffers}
    bucket = args.bucket_size_mb * 1024 * 1024 if args.bucket_size_mb else None
    run = measure_fanout(
        model_shape(args.model, args.layers),
        args.gpus,
        args.versions,
        args.warmup,
        args.timeout_s,
        bucket,
        args.floor_reps,
        args.flat,
        args.local_receiver,
        **extra,
    )
    print(summary(run), flush=True)
    print(json.dumps({**asdict(run), "seconds": run.seconds, "ratio": run.ratio}), flush=True)
    return 0 if run.bit_exact else 1


if __name__ == "__main__":
    sys.exit(main())
