"""A version split over several senders (one per trainer host), for :class:`~.core.ReceiverCore`.

Every part's ``start`` -> join the parts (:mod:`.parts`) and validate their union (verdict to
every sender) -> ``begin`` once -> each part's buckets read on a thread per sender (loads one
at a time) -> every part's ``end`` with matching checksums -> ``commit`` once, "applied" to
every sender. A part that fails fails the version for every sender.

:class:`SeveralSenders` is the half of ``ReceiverCore`` that does this; it calls the core's
per-version steps (``_begin``, ``_bucket``, ``_end``, ``_commit``, ``_fail``...) and what the
target accepted (:mod:`.accepted`), which the single-sender path shares.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from weightsync import gc_pause, trace
from weightsync.buckets import TensorSpec
from weightsync.errors import (
    ProtocolError,
    ReceiverFailedError,
    SyncTimeoutError,
    VersionError,
    WeightSyncError,
)
from weightsync.manifest import VersionManifest
from weightsync.receiver.links import Link, abandoned, ack_once_read, as_weightsync_error
from weightsync.receiver.parts import ArrivedPart, check_part, join_parts
from weightsync.receiver.reader import VersionReads
from weightsync.v1 import weightsync_pb2 as pb

_POLL_S = 0.2
"""How often a part's thread, waiting for its sender, looks whether the version was given up."""


class _Stopped(Exception):
    """The version was given up on while a part's thread waited for its sender."""


@dataclass
class _PartsRun:
    """One ``sync()`` of a receiver registered with several senders: a thread per sender
    reports to ``events`` and waits for the core's answer to its start in its ``replies``."""

    links: int
    events: queue.Queue[tuple[int, str, object, str]] = field(default_factory=queue.Queue)
    """(link, "start" | "ended" | "failed", the start message or error, where in the part:
    "its bucket 3", "after its bucket 3" or "")."""
    replies: list[queue.Queue[str]] = field(init=False)
    """Per link: "go" (load the part), "decline" (wait for the next start), "stop"."""
    stop: threading.Event = field(default_factory=threading.Event)
    failed: threading.Event = field(default_factory=threading.Event)
    """A part failed after the writes began: the others read on (their senders and broadcast
    groups keep in step) but load nothing more."""
    version: int = 0
    specs: Sequence[TensorSpec] = ()
    """The version's tensors (every part's), set before any part is told to go."""

    def __post_init__(self) -> None:
        self.replies = [queue.Queue() for _ in range(self.links)]

    def give_up(self) -> None:
        self.stop.set()
        for reply in self.replies:
            reply.put("stop")


class SeveralSenders:
    """The several-senders half of :class:`~.core.ReceiverCore` (a mixin: it runs on the
    core's links, target and per-version steps)."""

    def _sync_parts(self, deadline: float | None, wanted: int) -> int:
        run = _PartsRun(len(self._links))
        threads = [
            threading.Thread(
                target=self._run_part, args=(i, run), daemon=True, name=f"weightsync-part-{i}"
            )
            for i in range(len(self._links))
        ]
        for thread in threads:
            thread.start()
        try:
            return self._join_parts(run, deadline, wanted)
        finally:
            run.give_up()
            for thread in threads:
                thread.join()

    def _next(
        self, link: Link, run: _PartsRun, waiting_for: str, in_version: bool
    ) -> pb.Announcement:
        """The sender's next announcement, looking every ``_POLL_S`` whether ``run`` was
        given up on (then ``_Stopped``)."""
        while not run.stop.is_set():
            try:
                return link.connection.next(time.monotonic() + _POLL_S, waiting_for, in_version)
            except SyncTimeoutError:
                continue
        raise _Stopped

    def _run_part(self, i: int, run: _PartsRun) -> None:
        """One sender's part of ``run``, on a thread of its own: its start (answered by
        :meth:`_join_parts`), then its buckets, each read as it comes."""
        link = self._links[i]
        try:
            while True:
                msg, link.pending = link.pending, None
                if msg is None:
                    msg = self._next(link, run, "version", in_version=False)
                if msg.WhichOneof("kind") != "start":
                    continue  # leftovers of a version already left
                run.events.put((i, "start", msg, -1))
                reply = run.replies[i].get()
                if reply == "go":
                    break
                if reply == "stop":
                    link.pending = msg  # unanswered: the next sync() takes it up
                    return
        except _Stopped:
            return
        except Exception as e:
            run.events.put((i, "failed", e, ""))
            return
        version, where = run.version, ""
        reads = VersionReads(version, run.specs)
        try:
            while True:
                msg = self._next(link, run, f"bucket of version {version}", in_version=True)
                kind = msg.WhichOneof("kind")
                trace.mark(f"receiver.{kind}", index=msg.bucket.layout.index)
                if kind == "bucket":
                    bucket = link.bucket(msg.bucket)
                    where = f"its bucket {bucket.layout.index}"
                    load = not run.failed.is_set()
                    at = msg.bucket.version
                    ack_once_read(link, *self._bucket(link, bucket, at, reads, load))
                    where = f"after {where}"
                elif kind == "end":
                    if not run.failed.is_set():
                        self._end(link, reads, msg.end)
                    break
                elif kind == "abort":
                    raise abandoned(self.receiver_id, version, msg.abort)
                else:
                    raise ProtocolError(f"unexpected {kind} inside version {version}")
        except _Stopped:
            return
        except Exception as e:
            run.failed.set()  # the other parts stop loading at once
            run.events.put((i, "failed", e, where))
            return
        run.events.put((i, "ended", None, where))

    def _join_parts(self, run: _PartsRun, deadline: float | None, wanted: int) -> int:
        """Wait for every sender's start of one version, validate their union, then apply."""
        started: dict[int, pb.VersionStart] = {}
        parts_by: float | None = None
        while len(started) < len(self._links):
            until = parts_by if started else deadline
            try:
                i, kind, payload, _ = run.events.get(
                    timeout=None if until is None else max(until - time.monotonic(), 0.0)
                )
            except queue.Empty:
                if not started:
                    raise SyncTimeoutError(
                        f"receiver {self.receiver_id}: no version in time from any of the "
                        f"senders at {', '.join(self.addresses)}"
                    ) from None
                late = next(j for j in range(len(self._links)) if j not in started)
                got = ", ".join(self._links[j].address for j in sorted(started))
                raise self._give_up(
                    run,
                    started,
                    SyncTimeoutError(
                        f"version {run.version}: the part from the sender at "
                        f"{self._links[late].address} did not start within "
                        f"{self.part_timeout_s:g} s of the parts from {got}; the version "
                        f"fails on receiver {self.receiver_id} before any write"
                    ),
                ) from None
            if kind == "failed":
                assert isinstance(payload, Exception)
                raise self._give_up(run, started, as_weightsync_error(payload, "a part's start"))
            assert isinstance(payload, pb.Announcement)
            link, version = self._links[i], payload.start.manifest.version
            if link.decline is not None and link.decline[0] == version:
                link.verdict(version, link.decline[1])
                link.decline = None
                run.replies[i].put("decline")
            elif version < wanted:
                self._decline(link, version, wanted)
                run.replies[i].put("decline")
            elif version < run.version:
                self._superseded(link, version, run.version)
                run.replies[i].put("decline")
            else:
                if version > run.version:
                    for j in started:
                        self._superseded(self._links[j], run.version, version)
                        run.replies[j].put("decline")
                    started.clear()
                    parts_by = time.monotonic() + self.part_timeout_s
                run.version = version
                started[i] = payload.start
        trace.mark("receiver.start")
        # Paused from every part's start, not while waiting for one (an engine may wait long).
        with gc_pause.paused():
            return self._start_parts(run, started)

    def _start_parts(self, run: _PartsRun, started: dict[int, pb.VersionStart]) -> int:
        """Validate the union of every sender's part of ``run``, then apply it (or refuse it
        before any write, telling every sender)."""
        arrived, keys = [], []
        try:
            for i in range(len(self._links)):
                manifest, key = self._accepted.manifest(self._links[i], started[i])
                arrived.append(ArrivedPart(self._links[i].address, manifest))
                check_part(arrived[-1], self.addresses)
                keys.append(len(key).to_bytes(8, "little") + key)
            union = join_parts(arrived)
            self._accepted.validate(self.target, union, b"".join(keys))
            keeps = [
                self._accepted.keeps(self.target, part.manifest, key)
                for part, key in zip(arrived, keys, strict=True)
            ]
        except Exception as e:
            error = self._refuse(self._links, run.version, e)
            for reply in run.replies:
                reply.put("decline")
            if error is e:
                raise
            raise error from e
        for link, kept in zip(self._links, keeps, strict=True):
            link.verdict(run.version, None, kept)
        return self._apply_parts(run, arrived, union)

    def _superseded(self, link: Link, stale: int, newer: int) -> None:
        link.verdict(
            stale,
            VersionError(
                f"receiver {self.receiver_id} skipped version {stale} from the sender at "
                f"{link.address}: it waits for version {newer}, which another sender started"
            ),
        )

    def _give_up(
        self, run: _PartsRun, started: dict[int, pb.VersionStart], error: WeightSyncError
    ) -> WeightSyncError:
        """Fail ``run`` before any write: the senders whose part started hear it now, the
        others when theirs starts."""
        for i, link in enumerate(self._links):
            if i in started:
                link.verdict(run.version, error)
                run.replies[i].put("decline")
            elif run.version:
                link.decline = (run.version, error)
        self.last_error = error
        return error

    def _apply_parts(
        self, run: _PartsRun, arrived: list[ArrivedPart], union: VersionManifest
    ) -> int:
        """Load every part as its buckets come, each on its own thread; commit once all ended
        with matching checksums. A part that fails stops the loads, and, once every sender
        ended its part (their streams and broadcast groups stay in step), fails the version
        for every sender."""
        failure: tuple[int, str, Exception] | None = None
        """(link, where in its part, what failed); link -1: the target's begin or commit."""
        run.specs = union.tensors
        try:
            try:
                self._begin(union)
            except Exception as e:
                failure = (-1, "", e)
                run.failed.set()
            for reply in run.replies:
                reply.put("go")
            for _ in self._links:
                i, kind, payload, where = run.events.get()
                if kind == "failed" and failure is None:
                    assert isinstance(payload, Exception)
                    failure = (i, where, payload)
            if failure is None:
                try:
                    return self._commit(union)
                except Exception as e:
                    failure = (-1, "", e)
            i, where, cause = failure
            error = self._part_error(union.version, arrived[i] if i >= 0 else None, where, cause)
            aborted = isinstance(cause, ReceiverFailedError)
            tell = [link for j, link in enumerate(self._links) if not (aborted and j == i)]
            self._fail(union, error, tell)
            raise error from cause
        finally:
            self._weights.applying = False

    def _part_error(
        self, version: int, part: ArrivedPart | None, where: str, cause: Exception
    ) -> WeightSyncError:
        """``cause`` saying which sender's part (and bucket) failed the version, and whether
        the weights are now dirty."""
        context = ", ".join(str(x) for x in (part, where) if x)
        error = as_weightsync_error(
            cause, f"version {version}" + (f", {context}" if context else "")
        )
        message = f"version {version} failed on receiver {self.receiver_id}"
        message += f": {context}: {error}" if context else f": {error}"
        if self._touched:
            message += (
                ". The weights are dirty (buckets of the version were written before it "
                "failed): the next version every sender sends heals them"
            )
        return type(error)(message)
