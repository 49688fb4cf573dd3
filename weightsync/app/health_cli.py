"""``weightsync health``: does a sender answer, and is it serving? (wired in from
:mod:`weightsync.app.cli`). For container health checks, probes and scripts that wait for a
sender: it connects like every client (the token and TLS settings from ``WEIGHTSYNC_*``), so
a sender with TLS is checked over TLS, not refused as plaintext.

Exit codes: 0 serving; 1 nothing answers, or it is not serving (one line on stderr); 2 a bad
argument.
"""

from __future__ import annotations

import argparse
import sys

from weightsync.app import arguments
from weightsync.app.arguments import add_address_arg, client_address, one_line


def add_health_args(p: argparse.ArgumentParser) -> None:
    """Define the options of ``weightsync health`` on its subparser."""
    p.add_argument(
        "--timeout-s",
        type=arguments.seconds,
        default=5.0,
        help="give up after this long (default 5)",
    )
    add_address_arg(p)


def run_health(args: argparse.Namespace) -> int:
    from weightsync.control.client import connect
    from weightsync.errors import WeightSyncError

    address = client_address(args)
    try:
        channel, _ = connect(address, timeout_s=args.timeout_s)
    except WeightSyncError as e:
        print(f"weightsync: error: {one_line(e)}", file=sys.stderr, flush=True)
        return 1
    channel.close()
    print(f"serving: {address}", flush=True)
    return 0
