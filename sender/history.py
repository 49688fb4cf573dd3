"""The sender's version history: the last published version, the last ``history`` runs, and
``WaitApplied`` waiting for one of them.

Every method runs with ``cond`` held, the sender's one lock (see ``coordinator.py``); waiters
wake on it when a version is added or finishes.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from weightsync.errors import ProtocolError, SyncTimeoutError, TransportError, VersionError
from weightsync.sender.reports import version_status
from weightsync.sender.states import OutcomeState, VersionState
from weightsync.v1 import weightsync_pb2 as pb

if TYPE_CHECKING:
    from weightsync.sender.version import Version


class VersionHistory:
    """Versions by number, oldest first; only the last ``keep`` are kept (``Status`` shows
    them, ``WaitApplied`` answers for them)."""

    def __init__(self, cond: threading.Condition, keep: int) -> None:
        self._cond, self._keep = cond, keep
        self._runs: OrderedDict[int, Version] = OrderedDict()
        self._dropped = 0
        """The newest version dropped from the history (it may have been applied)."""
        self._closed = False

    @property
    def last_version(self) -> int:
        """The last published version that counts (see :meth:`_floor`); 0: none yet."""
        with self._cond:  # reentrant: callers may hold it already
            return self._floor()

    def runs(self) -> list[Version]:
        """The kept versions, oldest first (lock held)."""
        return list(self._runs.values())

    def newest(self) -> Version | None:
        """The version added last, if any (lock held)."""
        return next(reversed(self._runs.values()), None)

    def run_of(self, version: int) -> Version | None:
        with self._cond:
            return self._runs.get(version)

    def _floor(self) -> int:
        """The version a new one must exceed: versions only increase, past every one that was
        applied, is in flight or wrote anything. One that failed leaving no trace (a wrong
        manifest, a hostile huge number) does not hold the next back, and its number may be
        published again.

        The newest run that counts is the largest: each run exceeded every counted one when
        it was added, and a run that left no trace never counts again. So the scan stops at
        the first (usually the newest), not at every kept run a version."""
        for number in reversed(self._runs):
            if not left_no_trace(self._runs[number]):
                return max(number, self._dropped)
        return self._dropped

    def check_version(self, version: int) -> None:
        floor = self._floor()
        if version <= floor:
            raise VersionError(
                f"version {version} is not greater than the last published version "
                f"{floor}; publish {floor + 1} or later"
            )

    def add_run(self, run: Version) -> None:
        """Record a new version (checked by :meth:`check_version`), dropping the oldest past
        ``keep``."""
        self._runs.pop(run.version, None)  # one that left no trace, published again: newest
        self._runs[run.version] = run
        while len(self._runs) > self._keep:
            number, dropped = self._runs.popitem(last=False)
            if not left_no_trace(dropped):
                self._dropped = max(self._dropped, number)
            if dropped.gc_hold is not None:  # one never finished must not pause it for good
                dropped.gc_hold.release()
        self._cond.notify_all()  # WaitApplied callers waiting for it to be published

    def close(self) -> None:
        """The sender shuts down: every ``wait_applied`` ends with TransportError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait_applied(
        self, version: int, timeout_s: float, alive: Callable[[], bool] = lambda: True
    ) -> pb.VersionStatus:
        """Wait until ``version`` is complete or failed, first until it is published if it is
        not yet; ``timeout_s = 0`` waits without limit (``alive()`` false ends the wait: the
        caller left).

        Raises:
            VersionError: at once, for a version that is not in the history and never will
                be (0, older than the history, or not greater than the last published).
            SyncTimeoutError: past ``timeout_s``, naming the version and what it waited for.
            TransportError: the sender shut down while waiting.
        """
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        with self._cond:
            while True:
                run = self._runs.get(version)
                if run is None:
                    self._check_coming(version)
                elif run.done:
                    return version_status(run)
                if self._closed:
                    raise TransportError(
                        f"the sender shut down while WaitApplied waited for version {version}"
                    )
                if not alive():
                    raise ProtocolError(f"the caller of WaitApplied({version}) left")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    if run is None:
                        raise SyncTimeoutError(
                            f"version {version} was not published within {timeout_s:g} s "
                            f"(the last published version is {self.last_version})"
                        )
                    raise SyncTimeoutError(
                        f"version {version} not applied by every receiver within "
                        f"{timeout_s:g} s; still pending: {run.active()}"
                    )
                self._cond.wait(1.0 if left is None else min(left, 1.0))

    def _check_coming(self, version: int) -> None:
        """Raise VersionError if ``version``, not in the history, can never be waited for."""
        if version == 0:
            raise VersionError("version 0 is never published: versions start at 1")
        if version > self._floor():
            return  # not published yet: wait for it
        oldest = next(iter(self._runs), None)
        if oldest is not None and version < oldest:
            raise VersionError(
                f"version {version} is older than this sender's history (it keeps the last "
                f"{self._keep} versions, now {oldest}..{self.last_version}); "
                "its status is gone"
            )
        raise VersionError(
            f"version {version} was never published on this sender and never will be: "
            f"versions only increase and the last published is {self.last_version}"
        )


def left_no_trace(version: Version) -> bool:
    """Whether ``version`` failed before any receiver applied it or may have written a byte of
    it (every receiver rejected its manifest, or it was abandoned first): then its number is not
    used up. Every receiver's failure is final, so that holds from the last verdict on, even
    before the version itself is marked failed (its publisher may hear first)."""
    outcomes = version.outcomes.values()
    if any(o.wrote or o.state == OutcomeState.APPLIED for o in outcomes):
        return False
    return version.state == VersionState.FAILED or (
        bool(outcomes) and all(o.state == OutcomeState.FAILED for o in outcomes)
    )
