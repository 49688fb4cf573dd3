"""Command line: ``weightsync {sender,status,demo,trace,bench}`` and ``weightsync-sender``."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from weightsync.config import DEFAULT_ADDRESS
from weightsync.errors import WeightSyncError

MIB = 1024 * 1024


def _add_sender_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--listen",
        default=None,
        help=f"unix:/path or host:port (default: $WEIGHTSYNC_LISTEN or {DEFAULT_ADDRESS})",
    )
    p.add_argument(
        "--bucket-size-mb",
        type=int,
        default=None,
        help="staging bucket cap in MiB (default 512); tensors larger are chunked",
    )
    p.add_argument(
        "--num-buffers",
        type=int,
        default=None,
        help="staging buffers (default 2): packing bucket i+1 overlaps loading bucket i",
    )
    p.add_argument(
        "--transport",
        choices=["auto", "shm", "cuda_ipc", "nccl"],
        default=None,
        help="auto: receivers on this host map the staging buffers (cuda_ipc for CUDA "
        "tensors, shm for CPU ones), others get broadcasts; nccl: broadcast to every receiver",
    )
    p.add_argument(
        "--broadcast-host",
        default=None,
        help="address remote receivers reach the broadcast rendezvous at (default 127.0.0.1)",
    )
    p.add_argument(
        "--ack-timeout-s",
        type=float,
        default=None,
        help="fail a receiver that owes a reply this long (default 120)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (default off)",
    )


def _sender_settings(args: argparse.Namespace) -> dict:
    given = {
        "listen": args.listen,
        "bucket_size_bytes": args.bucket_size_mb * MIB if args.bucket_size_mb else None,
        "num_buffers": args.num_buffers,
        "transport": args.transport,
        "ack_timeout_s": args.ack_timeout_s,
        "metrics_port": args.metrics_port,
        "broadcast_host": args.broadcast_host,
    }
    return {k: v for k, v in given.items() if v is not None}


def _run_sender(args: argparse.Namespace, console: Console) -> int:
    from weightsync.sender import Sender

    sender = Sender(**_sender_settings(args))
    s = sender.settings
    console.print(
        f"weightsync-sender listening on {sender.address} (transport {s.transport}, "
        f"{s.num_buffers} x {s.bucket_size_bytes // MIB} MiB buckets); Ctrl-C stops"
    )
    sender.wait()
    return 0


def _run_status(args: argparse.Namespace, console: Console) -> int:
    from weightsync.control.client import connect
    from weightsync.v1 import weightsync_pb2 as pb

    channel, stub = connect(args.address, timeout_s=args.timeout_s)
    with channel:
        reply = stub.Status(pb.StatusRequest(), timeout=args.timeout_s)
    console.print(
        f"sender {reply.sender_version} at {args.address}: transport {reply.transport}, "
        f"{reply.num_buffers} x {reply.bucket_size_bytes // MIB} MiB buckets"
    )
    receivers = Table(title="receivers")
    columns = ("id", "engine", "rank", "device", "data path", "connected", "applied", "state")
    for col in (*columns, "last error"):
        receivers.add_column(col)
    for r in reply.receivers:
        receivers.add_row(
            r.receiver_id,
            r.engine,
            str(r.rank),
            r.device,
            r.data_path,
            str(r.connected),
            str(r.applied_version),
            r.state,
            r.last_error[:80],
        )
    console.print(receivers)
    versions = Table(title="versions")
    for col in (
        "version",
        "state",
        "MB",
        "MB direct",
        "packed by",
        "tensors",
        "buckets",
        "staged s",
        "complete s",
        "applied",
    ):
        versions.add_column(col)
    for v in reply.versions[-args.last :]:
        applied = sum(o.state == "applied" for o in v.receivers)
        versions.add_row(
            str(v.version),
            v.state,
            f"{v.total_bytes / 1e6:.1f}",
            f"{v.direct_bytes / 1e6:.1f}",
            "sender" if v.sender_packed else "publisher",
            str(v.num_tensors),
            str(v.num_buckets),
            f"{v.staged_s:.3f}",
            f"{v.complete_s:.3f}",
            f"{applied}/{len(v.receivers)}",
        )
    console.print(versions)
    return 0


def _run_demo(args: argparse.Namespace, console: Console) -> int:
    from weightsync.app.demo import DemoConfig, run_demo

    cfg = DemoConfig(
        versions=args.versions,
        receivers=args.receivers,
        transport=args.transport,
        device=args.device,
    )
    ok = run_demo(cfg, console)
    print(
        f"demo: {cfg.versions} versions to {cfg.receivers} receivers, "
        f"bit-exact: {'yes' if ok else 'no'}"
    )
    return 0 if ok else 1


def _run_bench(args: argparse.Namespace, console: Console) -> int:
    from weightsync.app.bench.cli import run_bench

    return run_bench(args, console)


def _run_trace(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from weightsync import trace

    events = trace.load(args.dir)
    if not events:
        console.print(f"no trace files (*.jsonl) under {args.dir}", soft_wrap=True)
        return 1
    # Every publisher rank marks its own `publish`: a version starts at its first one.
    starts: dict[int, int] = {}
    for e in events:
        if e["event"] == "publish":
            starts.setdefault(e["version"], e["t_ns"])
    if args.version and args.version not in starts:
        console.print(f"no publish of version {args.version} traced; traced: {sorted(starts)}")
        return 1
    console = Console()  # the timeline is this command's output: stdout
    first = min(starts.values(), default=events[0]["t_ns"])
    start = starts[args.version] if args.version else first
    later = [t for v, t in starts.items() if v > args.version] if args.version else []
    stop = min(later, default=None)
    table = Table(title=f"weightsync trace {args.dir} (ms from publish)")
    for col in ("ms", "+ms", "process", "thread", "event", "fields"):
        table.add_column(col, justify="right" if "ms" in col else "left")
    last = start
    for e in events:
        if e["t_ns"] < start or (stop is not None and e["t_ns"] >= stop):
            continue
        fields = {k: v for k, v in e.items() if k not in ("t_ns", "process", "thread", "event")}
        table.add_row(
            f"{(e['t_ns'] - start) / 1e6:.3f}",
            f"{(e['t_ns'] - last) / 1e6:.3f}",
            e["process"],
            e["thread"],
            e["event"],
            " ".join(f"{k}={v}" for k, v in fields.items()),
        )
        last = e["t_ns"]
    console.print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightsync",
        description="Move freshly trained weights into running inference engines, exactly.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("sender", help="run the sender daemon (same as weightsync-sender)")
    _add_sender_args(p)
    p.set_defaults(func=_run_sender)

    p = sub.add_parser("status", help="show a sender's receivers and versions")
    p.add_argument("--address", default=DEFAULT_ADDRESS, help="the sender's address")
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.add_argument("--last", type=int, default=10, help="how many recent versions to list")
    p.set_defaults(func=_run_status)

    p = sub.add_parser("demo", help="sender + trainer + receivers on this machine, bit-exact check")
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--receivers", type=int, default=2)
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
    p.set_defaults(func=_run_trace)

    p = sub.add_parser("bench", help="measure sync time against the hardware floor (GPU)")
    from weightsync.app.bench.cli import add_bench_args

    add_bench_args(p)
    p.set_defaults(func=_run_bench, bench_parser=p)
    return parser


def _log_to(console: Console) -> None:
    import logging

    from rich.logging import RichHandler

    logging.basicConfig(
        level=logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )


def main(argv: list[str] | None = None) -> int:
    console = Console(stderr=True)
    _log_to(console)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args, console)
    except WeightSyncError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2


def sender_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="weightsync-sender",
        description="Run the weightsync sender daemon beside a trainer: it hosts the gRPC "
        "control plane and the staging buffers. Every option can also be set with a "
        "WEIGHTSYNC_* environment variable (e.g. WEIGHTSYNC_LISTEN).",
    )
    _add_sender_args(parser)
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    _log_to(console)
    try:
        return _run_sender(args, console)
    except WeightSyncError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
