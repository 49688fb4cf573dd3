"""``weightsync wait VERSION``: block until a version is applied by every receiver it was
addressed to (or failed), waiting first for it to be published; print its ``VersionStatus``
on stdout (wired in from :mod:`weightsync.app.cli`).

Exit codes: 0 every receiver applied it; 1 it finished failed for some receiver, or the wait
ended without an outcome (timeout, a version that will never come, no sender), with one line
on stderr; 2 a bad argument.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime

from rich.text import Text

from weightsync.app import arguments, output
from weightsync.app.arguments import add_address_arg, client_address, one_line
from weightsync.app.status_cli import message_json, versions_table

_timeout = arguments.checked(float, lambda v: v >= 0, "a number of seconds >= 0 (0: no limit)")


def add_wait_args(p: argparse.ArgumentParser) -> None:
    """Define the options of ``weightsync wait`` on its subparser."""
    p.add_argument("version", type=arguments.positive_int, help="the version to wait for")
    p.add_argument(
        "--timeout-s",
        type=_timeout,
        default=600.0,
        help="give up after this long, published or not (default 600; 0: no limit)",
    )
    add_address_arg(p)
    p.add_argument(
        "--json", action="store_true", help="print the VersionStatus as JSON (proto field names)"
    )


def run_wait(args: argparse.Namespace) -> int:
    from weightsync.errors import (
        ReceiverFailedError,
        SyncTimeoutError,
        TransportError,
        VersionError,
    )
    from weightsync.sender import Publisher

    failed: ReceiverFailedError | None = None
    try:
        with Publisher(client_address(args)) as publisher:
            try:
                status = publisher.wait_applied(args.version, args.timeout_s)
            except ReceiverFailedError as e:
                # The error only lists the failures: the status itself is still in the history.
                failed = e
                status = next(
                    (v for v in publisher.status().versions if v.version == args.version), None
                )
    except (SyncTimeoutError, VersionError, TransportError) as e:
        _error(e)
        return 1
    if status is not None:
        _print(status, args.json)
    if failed is not None:
        _error(failed)
        return 1
    return 0


def _error(error: BaseException) -> None:
    print(f"weightsync: error: {one_line(error)}", file=sys.stderr, flush=True)


def _print(status, as_json: bool) -> None:
    if as_json:
        print(message_json(status, 2), flush=True)
        return
    outcomes = output.table("receiver", "state", "applied at", "error", title="receivers")
    for o in status.receivers:
        at = datetime.fromtimestamp(o.applied_at_unix_s).isoformat(" ", "seconds")
        output.add_row(
            outcomes,
            o.receiver_id,
            o.state,
            at if o.applied_at_unix_s else "",
            one_line(o.error.message),
        )
    console = output.console()
    console.print(Text(f"version {status.version}: {status.state}"))
    console.print(versions_table([status]))
    console.print(outcomes)
    console.file.flush()
