"""Command line: ``weightsync {sender,status,wait,demo,trace,bench}`` and ``weightsync-sender``.

This module wires the commands into one parser and runs them; each command's options and
entry point live in its own module (``sender_cli``, ``status_cli``, ``wait_cli``,
``bench.cli``). Every bad argument or setting ends the command with exit code 2 and one line
on stderr naming it and the values it accepts (``weightsync-sender: error: ...``); command
output (``status``, ``wait``, ``trace``) goes to stdout, logs to stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from weightsync.app import output
from weightsync.app.arguments import Parser, one_line, positive_int, version_arg
from weightsync.app.health_cli import add_health_args, run_health
from weightsync.app.plan_cli import add_plan_args, run_plan
from weightsync.app.sender_cli import add_sender_args, run_sender
from weightsync.app.status_cli import add_status_args, run_status
from weightsync.app.wait_cli import add_wait_args, run_wait
from weightsync.errors import WeightSyncError


def _run_demo(args: argparse.Namespace) -> int:
    from weightsync.app.demo import DemoConfig, run_demo

    cfg = DemoConfig(
        versions=args.versions,
        receivers=args.receivers,
        transport=args.transport,
        device=args.device,
    )
    ok = run_demo(cfg, output.console(stderr=True))
    print(
        f"demo: {cfg.versions} versions to {cfg.receivers} receivers, "
        f"bit-exact: {'yes' if ok else 'no'}"
    )
    return 0 if ok else 1


def _run_bench(args: argparse.Namespace) -> int:
    from weightsync.app.bench.cli import run_bench

    return run_bench(args, output.console(stderr=True))


def _run_trace(args: argparse.Namespace) -> int:
    from weightsync import trace

    events = trace.load(args.dir)
    if not events:
        print(f"no trace files (*.jsonl) under {args.dir}", file=sys.stderr)
        return 1
    # Every publisher rank marks its own `publish`: a version starts at its first one.
    starts: dict[int, int] = {}
    for e in events:
        if e["event"] == "publish":
            starts.setdefault(e["version"], e["t_ns"])
    if args.version and args.version not in starts:
        print(
            f"no publish of version {args.version} traced; traced: {sorted(starts)}",
            file=sys.stderr,
        )
        return 1
    first = min(starts.values(), default=events[0]["t_ns"])
    start = starts[args.version] if args.version else first
    later = [t for v, t in starts.items() if v > args.version] if args.version else []
    stop = min(later, default=None)
    table = output.table(
        "ms", "+ms", "process", "thread", "event", "fields",
        title=f"weightsync trace {args.dir} (ms from publish)", right=("ms", "+ms"),
    )  # fmt: skip
    last = start
    for e in events:
        if e["t_ns"] < start or (stop is not None and e["t_ns"] >= stop):
            continue
        waited, last = e["t_ns"] - last, e["t_ns"]
        if waited < args.gaps * 1e6:
            continue
        fields = {k: v for k, v in e.items() if k not in ("t_ns", "process", "thread", "event")}
        output.add_row(
            table,
            f"{(e['t_ns'] - start) / 1e6:.3f}",
            f"{waited / 1e6:.3f}",
            e["process"],
            e["thread"],
            e["event"],
            " ".join(f"{k}={v}" for k, v in fields.items()),
        )
    output.console().print(table)  # the timeline is this command's output: stdout
    return 0


def build_parser(bench: bool = True) -> argparse.ArgumentParser:
    """The ``weightsync`` parser; ``bench=False`` leaves out the bench's options, whose
    definitions import torch (so ``--version``, ``status``, errors answer fast)."""
    parser = Parser(
        prog="weightsync",
        description="Move freshly trained weights into running inference engines, exactly.",
    )
    version_arg(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("sender", help="run the sender daemon (same as weightsync-sender)")
    add_sender_args(p)
    p.set_defaults(func=run_sender)

    p = sub.add_parser(
        "status",
        help="show a sender's receivers, publishers and versions (stdout)",
        description="Show a sender's receivers, publishers and recent versions on stdout.",
    )
    add_status_args(p)
    p.set_defaults(func=run_status)

    p = sub.add_parser(
        "wait",
        help="wait until a version is applied by every receiver (or failed); print its status",
        description="Wait for VERSION (first for it to be published) until every receiver it "
        "was addressed to applied it or failed; print its status on stdout. Exit 0: every "
        "receiver applied it; 1: it failed for some receiver, or timeout / no such version / "
        "no sender (one line on stderr); 2: a bad argument.",
    )
    add_wait_args(p)
    p.set_defaults(func=run_wait)

    p = sub.add_parser(
        "health",
        help="exit 0 when a sender answers and is serving (container health checks)",
        description="Connect to a sender as every client does (token and TLS from "
        "WEIGHTSYNC_*) and check grpc.health.v1. Exit 0: serving; 1: nothing answers or it is "
        "not serving (one line on stderr); 2: a bad argument.",
    )
    add_health_args(p)
    p.set_defaults(func=run_health)

    p = sub.add_parser(
        "plan",
        help="plan a described cluster offline: bytes per link, predicted time, floor",
        description="Plan a weight sync on a described cluster (model, Megatron trainer, "
        "engines, link rates) with the planner the senders run; print the bytes per link "
        "class, the busiest NIC, the predicted time, the floor and what bounds them.",
    )
    add_plan_args(p)
    p.set_defaults(func=run_plan)

    p = sub.add_parser("demo", help="sender + trainer + receivers on this machine, bit-exact check")
    p.add_argument("--versions", type=positive_int, default=3)
    p.add_argument("--receivers", type=positive_int, default=2)
    p.add_argument(
        "--transport",
        choices=["auto", "shm", "cuda_ipc"],
        default="auto",
        help="auto: cuda_ipc on a CUDA machine, shm otherwise",
    )
    p.add_argument("--device", default="auto", help="auto: cuda:0 when available, else cpu")
    p.set_defaults(func=_run_demo)

    p = sub.add_parser(
        "trace",
        help="print the timeline recorded with WEIGHTSYNC_TRACE_DIR set (every process)",
    )
    p.add_argument("dir", help="the WEIGHTSYNC_TRACE_DIR the processes wrote to")
    p.add_argument(
        "--version", type=int, default=0, help="only this version (from its first publish)"
    )
    p.add_argument(
        "--gaps",
        type=float,
        default=0.0,
        metavar="MS",
        help="only the events that came at least MS milliseconds after the one before them "
        "(+ms still counts from that one, shown or not): where a version waited",
    )
    p.set_defaults(func=_run_trace)

    p = sub.add_parser("bench", help="measure sync time against the hardware floor (GPU)")
    if bench:
        from weightsync.app.bench.cli import add_bench_args

        add_bench_args(p)
    p.set_defaults(func=_run_bench, bench_parser=p)
    return parser


def _run(prog: str, args: argparse.Namespace, func: Callable[[argparse.Namespace], int]) -> int:
    """Configure logging, run ``func``; our errors become one line on stderr and exit code 2."""
    from weightsync.logs import configure_logging

    try:
        configure_logging(getattr(args, "log_level", None), getattr(args, "log_format", None))
        return func(args)
    except WeightSyncError as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(bench="bench" in argv).parse_args(argv)
    return _run("weightsync", args, args.func)


def sender_main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="weightsync-sender",
        description="Run the weightsync sender daemon beside a trainer: it hosts the gRPC "
        "control plane and the staging buffers. Every option can also be set with a "
        "WEIGHTSYNC_* environment variable (e.g. WEIGHTSYNC_LISTEN); a bad one ends it with "
        "exit code 2 and one line naming it.",
    )
    version_arg(parser)
    add_sender_args(parser)
    args = parser.parse_args(argv)
    return _run("weightsync-sender", args, run_sender)


if __name__ == "__main__":
    sys.exit(main())
