"""``weightsync bench`` run in the test's process."""

from __future__ import annotations

import argparse

from rich.console import Console

from weightsync.app.bench.cli import add_bench_args, run_bench


def bench(argv: list[str]) -> int:
    """Run ``weightsync bench`` with ``argv`` here (report on stderr, 200 columns); returns
    its exit code."""
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return run_bench(parser.parse_args(argv), Console(stderr=True, width=200))
