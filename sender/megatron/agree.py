"""Ranks agree on a step's outcome before the next collective, so one failure fails them all.

A rank that raises alone (a parameter no rule knows on one pipeline stage, a shape rule that
fails on one tensor-parallel rank, a sender unreachable from one node) would otherwise leave
every other rank inside the next collective until the process-group timeout. Each step that
can fail on one rank runs locally, then one ``all_gather_object`` of an error-or-None tells
every rank what happened everywhere, and every rank raises the same error at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from weightsync.errors import WeightSyncError

T = TypeVar("T")


def run_agreed(
    step: str,
    fn: Callable[[], T],
    where: Callable[[], str],
    error_type: type[WeightSyncError],
    group: object = None,
) -> T:
    """Run ``fn`` on this rank, then agree with every rank of ``group`` that none failed.

    Args:
        step: what the ranks were doing, for the message (``"planning"``).
        fn: this rank's part; any exception it raises is reported to every rank.
        where: this rank's coordinates for the message (e.g. ``tp1/2 pp0/2``); called only
            when ``fn`` failed, and allowed to fail itself.
        error_type: what every rank raises when some rank failed.
        group: the torch.distributed group (default: the world); without an initialized
            process group ``fn``'s own exception propagates unchanged.

    Raises:
        error_type: on every rank when any rank's ``fn`` raised, naming each failed rank
            (its rank in ``group``, its coordinates) and its error, chained to this rank's
            own exception where it failed.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return fn()
    result: T | None = None
    error: BaseException | None = None
    try:
        result = fn()
    except Exception as e:  # reported to every rank below, then raised on every rank
        error = e
    report = None if error is None else _describe(dist.get_rank(group), where, error)
    reports: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, report, group=group)
    failed = [r for r in reports if r is not None]
    if failed:
        raise error_type(
            f"{step} failed on {len(failed)} of {len(reports)} trainer ranks, so every rank "
            f"stops here: {'; '.join(failed)}"
        ) from error
    return result  # type: ignore[return-value]  # fn returned: result holds its value


def _describe(rank: int, where: Callable[[], str], error: BaseException) -> str:
    try:
        coordinates = where()
    except Exception as e:  # the coordinates are what failed; say so instead
        coordinates = f"coordinates unknown: {e}"
    return f"rank {rank} ({coordinates}): {type(error).__name__}: {error}"
