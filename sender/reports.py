"""What a version reports: ``staged`` and ``done`` to its publishers (:func:`tell_staged`,
:func:`tell_done`), its entry in ``Status``, ``WaitApplied`` and ``done``
(:func:`version_status`), and its one log line once it is over (:func:`log_line`); and what
its receivers may report back, when (:func:`take_owed`)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import torch

from weightsync.errors import ProtocolError
from weightsync.sender.states import OutcomeState
from weightsync.v1 import weightsync_pb2 as pb

if TYPE_CHECKING:
    from weightsync.sender.announcements import Send
    from weightsync.sender.publisher_packs import PublisherPacks
    from weightsync.sender.records import Outcome
    from weightsync.sender.slots import Slot
    from weightsync.sender.version import Version


def tell_staged(version: Version) -> None:
    """``staged`` to each publisher rank that takes it (one that waits for ``done`` and said
    ``staged_in_done`` takes ``done`` as ``staged``)."""
    staged = pb.SenderReply(
        staged=pb.VersionStaged(version=version.version, receivers=len(version.outcomes))
    )
    for rank in version.ranks.values():
        if not rank.staged_in_done:
            rank.outbox.put(staged)


def tell_done(version: Version) -> None:
    """``done`` to every publisher rank of the version, when they wait for it."""
    if version.notify_done:
        done = pb.SenderReply(done=version_status(version))
        for rank in version.ranks.values():
            rank.outbox.put(done)


def version_status(version: Version) -> pb.VersionStatus:
    direct = version.tensors.direct
    return pb.VersionStatus(
        version=version.version,
        state=version.state,
        total_bytes=version.manifest.total_bytes,
        direct_bytes=direct.nbytes if direct else 0,
        staged_bytes=version.tensors.staged.total_bytes,
        sender_packed=version.regions is not None,
        route_bytes=version.route_bytes,
        abandoned=version.abandoned,
        num_tensors=len(version.manifest.tensors),
        num_buckets=len(version.tensors.staged.buckets) + (1 if direct else 0),
        started_at_unix_s=version.started_at,
        plan_s=version.plan_s,
        broadcast_bytes=version.wire.nbytes,
        delta_buckets=version.wire.deltas,
        staged_s=version.staged_s,
        complete_s=version.complete_s,
        receivers=[
            pb.ReceiverOutcome(
                receiver_id=rid,
                state=o.state,
                error=o.error,
                applied_at_unix_s=o.applied_at,
                direct_route_bytes=read.route_bytes
                if (read := version.direct_reads.get(rid))
                else {},
                written_buckets=version.writes.counts[rid],
            )
            for rid, o in sorted(version.outcomes.items())
        ],
    )


class LogLine(NamedTuple):
    """One INFO line to write off the lock: its text and its structured fields."""

    message: str
    extra: dict


def log_line(version: Version, abandoned: str = "") -> LogLine:
    """The one log line of a finished version, with its timings as structured fields."""
    applied = sum(o.state == OutcomeState.APPLIED for o in version.outcomes.values())
    direct = version.tensors.direct
    direct_bytes = direct.nbytes if direct else 0
    failures = {
        rid: _one_line(o.error.message if o.error is not None else "")
        for rid, o in version.outcomes.items()
        if o.state == OutcomeState.FAILED
    }
    message = (
        f"version {version.version} {version.state}: {version.manifest.total_bytes / 1e6:.1f} MB "
        f"({direct_bytes / 1e6:.1f} MB direct), {len(version.tensors.staged.buckets)} bucket(s), "
        f"planned {version.plan_s:.3f} s, staged {version.staged_s:.3f} s, "
        f"done {version.complete_s:.3f} s, applied by {applied}/{len(version.outcomes)} receiver(s)"
        + (f"; abandoned: {_one_line(abandoned)}" if abandoned else "")
        + "".join(f"; {rid} failed: {why}" for rid, why in failures.items())
    )
    extra = {
        "event": "version_finished",
        "version": version.version,
        "state": version.state,
        "total_bytes": version.manifest.total_bytes,
        "direct_bytes": direct_bytes,
        "buckets": len(version.tensors.staged.buckets),
        "plan_s": round(version.plan_s, 6),
        "staged_s": round(version.staged_s, 6),
        "done_s": round(version.complete_s, 6),
        "applied": applied,
        "receivers": len(version.outcomes),
        "sender_packed": version.regions is not None,
        "route_bytes": dict(version.route_bytes),
        "publisher_id": version.publisher_id,
        "failed": failures,
    }
    if abandoned:
        extra["abandoned"] = _one_line(abandoned)
    return LogLine(message, extra)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def take_owed(outcome: Outcome, receiver_id: str, version: Version, what: str, ok: bool) -> None:
    """Receiver ``receiver_id``, still in ``version``, sent ``what`` ("verdict", "bucket:<i>"
    or "applied", as ``Outcome.awaiting`` says): it owes it no more. An ack only for a bucket
    announced to it and not acked yet, ``applied`` only after the end and every ack (else a
    receiver that acks what it never got is reported applied); a failure (``ok`` false) is
    taken whenever.

    Raises:
        ProtocolError: naming the receiver, the version and what it sent out of turn.
    """
    if ok:
        _check_owed(outcome, receiver_id, version.version, what)
    outcome.got(what, version.shared.settings.ack_timeout_s)


def _check_owed(outcome: Outcome, receiver_id: str, version: int, what: str) -> None:
    if what.startswith("bucket:") and what not in outcome.awaiting:
        raise ProtocolError(
            f"receiver {receiver_id} acked bucket {what.removeprefix('bucket:')} of version "
            f"{version}, which was not announced to it or which it acked already; ack each "
            "bucket announced to you once"
        )
    if what != "applied":
        return
    if what not in outcome.awaiting:
        raise ProtocolError(
            f"receiver {receiver_id} sent applied for version {version} before the version's "
            "end; send applied after the end"
        )
    owed = sorted(outcome.awaiting - {what})
    if owed:
        raise ProtocolError(
            f"receiver {receiver_id} sent applied for version {version} before "
            f"{', '.join(_named(w) for w in owed)}; ack every bucket announced to you first"
        )


def _named(what: str) -> str:
    index = what.removeprefix("bucket:")
    return f"its ack of bucket {index}" if index != what else f"its {what}"


def release_publishers(
    version: Version,
    issued: deque[tuple[Send, Slot]],
    device: torch.device,
    packs: PublisherPacks | None,
) -> None:
    """The version ended early, every receiver having failed: the publishers are told at
    once (``staged``; ``done`` when they wait for it), once nothing of theirs is read or
    written (:meth:`PublisherPacks.settle`)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    with version.shared.cond:
        if packs is not None:
            packs.release(issued, version.shared.slots)
        tell_staged(version)
        tell_done(version)
