"""Argument parsing shared by every ``weightsync`` command: the one-line-error parser, checked
argument types (each names the values it accepts), and the options several commands share.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

from weightsync import __version__
from weightsync.addresses import parse_address
from weightsync.config import ADDRESS_ENV, DEFAULT_ADDRESS, LOG_FORMATS, LOG_LEVELS, SenderSettings
from weightsync.errors import ConfigError


class Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (no usage block): ``prog: error: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def bench_alone_parser(doc: str) -> argparse.ArgumentParser:
    """The parser of a bench run alone (``python -m weightsync.app.bench.fp8`` and the like):
    its ``--help`` gives the module docstring's first paragraph, whole."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def checked(kind: Callable[[str], float], ok: Callable[[float], bool], accepted: str):
    """An argparse ``type`` that accepts ``kind(text)`` when ``ok``; else names ``accepted``."""

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is invalid; expected {accepted}")
        return value

    convert.__name__ = kind.__name__
    return convert


def address(text: str) -> str:
    try:
        parse_address(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


positive_int = checked(int, lambda v: v > 0, "a positive integer")
mib = checked(int, lambda v: v > 0, "a positive whole number of MiB (default 512)")
buffers = checked(int, lambda v: v >= 2, SenderSettings.ACCEPTED["num_buffers"])
seconds = checked(float, lambda v: v > 0, "a number of seconds > 0")
port = checked(int, lambda v: 0 <= v <= 65535, SenderSettings.ACCEPTED["metrics_port"])
megabytes = checked(int, lambda v: v >= 0, "a whole number of MiB >= 0")
streams = checked(int, lambda v: v >= 1, SenderSettings.ACCEPTED["max_streams"])


def add_log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=None,
        help="debug, info, warning, error or critical (default: $WEIGHTSYNC_LOG_LEVEL or info)",
    )
    p.add_argument(
        "--log-format",
        type=str.lower,
        choices=LOG_FORMATS,
        default=None,
        help="text: one line per record (rich colours on a terminal); json: one JSON object "
        "per line with time, level, logger, message and fields (default: "
        "$WEIGHTSYNC_LOG_FORMAT or text)",
    )


def version_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


def add_address_arg(p: argparse.ArgumentParser) -> None:
    """``--address``: the sender a client command talks to."""
    p.add_argument(
        "--address",
        type=address,
        default=None,
        help=f"the sender's address (default: ${ADDRESS_ENV}, else $WEIGHTSYNC_LISTEN, "
        f"else {DEFAULT_ADDRESS}); a sender's token and TLS files come from $WEIGHTSYNC_TOKEN "
        "(or $WEIGHTSYNC_TOKEN_FILE) and $WEIGHTSYNC_TLS_CA, $WEIGHTSYNC_TLS_CERT, "
        "$WEIGHTSYNC_TLS_KEY",
    )


def client_address(args: argparse.Namespace) -> str:
    """``--address``, else the address a client on this host uses by default."""
    from weightsync.config import client_address as default_address

    return args.address or default_address()
