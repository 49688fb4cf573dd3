"""``weightsync status``: a sender's receivers, publishers and versions on stdout, as tables
or JSON, once or ``--watch``-ed (wired in from :mod:`weightsync.app.cli`)."""

from __future__ import annotations

import argparse
import time

from rich.table import Table
from rich.text import Text

from weightsync.app import arguments, output
from weightsync.app.arguments import add_address_arg, client_address, one_line

MIB = 1024 * 1024


def add_status_args(p: argparse.ArgumentParser) -> None:
    """Define the options of ``weightsync status`` on its subparser."""
    add_address_arg(p)
    p.add_argument(
        "--timeout-s", type=arguments.seconds, default=5.0, help="connect and RPC deadline"
    )
    p.add_argument(
        "--last", type=arguments.positive_int, default=10, help="how many recent versions to list"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the StatusReply as JSON (proto field names); with --watch one object per line",
    )
    p.add_argument(
        "--watch",
        nargs="?",
        type=arguments.seconds,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    p.add_argument(
        "--count",
        type=arguments.positive_int,
        default=None,
        help="with --watch: stop after this many refreshes",
    )


def message_json(reply, indent: int | None) -> str:
    """A reply as JSON with proto field names and every field, set or not."""
    import json

    from google.protobuf import json_format

    options = dict(preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    try:  # 64-bit integers (versions, bytes) as JSON numbers where the runtime can
        data = json_format.MessageToDict(reply, unquote_int64_if_possible=True, **options)
    except TypeError:
        data = json_format.MessageToDict(reply, **options)
    return json.dumps(data, indent=indent)


def _status_tables(reply, address: str, last: int) -> list:
    receivers = output.table(
        "id", "engine", "rank", "device", "data path", "stream", "MB kept", "connected",
        "applied", "state", "catch-up", "last error", title="receivers",
        right=("rank", "MB kept", "applied"),
    )  # fmt: skip
    for r in reply.receivers:
        output.add_row(
            receivers,
            r.receiver_id,
            r.engine,
            str(r.rank),
            r.device,
            r.data_path,
            "lane" if r.lane else "gRPC",  # its messages' path (docs/protocol.md §1.1)
            # What it keeps (its TP shard) of the last version it accepted; "-": none yet.
            f"{r.kept_bytes / 1e6:.1f}" if r.kept_bytes else "-",
            str(r.connected),
            str(r.applied_version),
            r.state,
            r.catch_up or "-",
            one_line(r.last_error),
        )
    publishers = output.table(
        "id", "ranks connected", "on lanes", "world size", "device", title="publishers",
        right=("ranks connected", "on lanes", "world size"),
    )  # fmt: skip
    for p in reply.publishers:
        output.add_row(
            publishers,
            p.publisher_id,
            str(p.ranks_connected),
            str(p.ranks_on_lanes),
            str(p.world_size),
            p.device,
        )
    head = (
        f"sender {reply.sender_version} at {address}: transport {reply.transport}, "
        f"{reply.num_buffers} x {_size(reply.bucket_size_bytes)} buckets"
    )
    tables = [Text(head), receivers, publishers, versions_table(reply.versions[-last:])]
    return tables + ([catch_ups_table(reply.catch_ups[-last:])] if reply.catch_ups else [])


def catch_ups_table(catch_ups) -> Table:
    """One row per ``CatchUpStatus``: who caught up to which version from whom, how long."""
    table = output.table(
        "receiver", "version", "from", "route", "state", "MB", "complete s", "error",
        title="catch-ups",
        right=("version", "MB", "complete s"),
    )  # fmt: skip
    for c in catch_ups:
        output.add_row(
            table,
            c.receiver_id,
            str(c.version),
            c.source,
            c.route,
            c.state,
            f"{c.bytes / 1e6:.1f}",
            f"{c.complete_s:.3f}" if c.complete_s else "-",
            one_line(c.error.message),
        )
    return table


def versions_table(versions) -> Table:
    """One row per ``VersionStatus``: its state, sizes, timings and receivers applied."""
    numbers = (
        "version", "MB", "MB direct", "tensors", "buckets", "written", "plan s", "staged s",
        "complete s",
    )  # fmt: skip
    table = output.table(
        "version", "state", "MB", "MB direct", "packed by", "tensors", "buckets", "written",
        "plan s", "staged s", "complete s", "applied", "MB by route", title="versions",
        right=numbers,
    )  # fmt: skip
    for v in versions:
        applied = sum(o.state == "applied" for o in v.receivers)
        # Buckets the sender wrote into receivers' weights itself, all receivers together.
        written = sum(o.written_buckets for o in v.receivers)
        # All receivers together; routes that carried nothing are left out.
        routes = ", ".join(f"{k} {n / 1e6:.1f}" for k, n in sorted(v.route_bytes.items()) if n)
        output.add_row(
            table,
            str(v.version),
            v.state,
            f"{v.total_bytes / 1e6:.1f}",
            f"{v.direct_bytes / 1e6:.1f}",
            "sender" if v.sender_packed else "publisher",
            str(v.num_tensors),
            str(v.num_buckets),
            str(written) if written else "-",
            f"{v.plan_s:.3f}",
            f"{v.staged_s:.3f}",
            f"{v.complete_s:.3f}",
            f"{applied}/{len(v.receivers)}",
            routes or "-",
        )
    return table


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1024)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} bytes"


def run_status(args: argparse.Namespace) -> int:
    import grpc

    from weightsync.control.client import connect
    from weightsync.errors import error_from_rpc
    from weightsync.v1 import weightsync_pb2 as pb

    address = client_address(args)
    console = output.console()
    channel, stub = connect(address, timeout_s=args.timeout_s)
    shown = 0
    with channel:
        while True:  # until --count refreshes, or Ctrl-C (a normal end of --watch: exit 0)
            try:
                reply = stub.Status(pb.StatusRequest(), timeout=args.timeout_s)
            except grpc.RpcError as e:
                raise error_from_rpc(e, f"status of the sender at {address}") from None
            if args.json:
                # --watch: one object per line (JSON lines); once: indented
                print(message_json(reply, None if args.watch else 2), flush=True)
            else:
                if args.watch and console.is_terminal:
                    console.clear()
                elif shown:
                    console.print()
                for part in _status_tables(reply, address, args.last):
                    console.print(part)
                if args.watch:
                    console.print(f"every {args.watch:g} s; Ctrl-C stops", style="dim")
                console.file.flush()
            shown += 1
            if not args.watch or (args.count and shown >= args.count):
                return 0
            try:
                time.sleep(args.watch)
            except KeyboardInterrupt:
                return 0
