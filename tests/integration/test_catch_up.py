"""Issue 33: a receiver that registers behind the current version (a late engine, one killed
and restarted under its id) gets that version, exactly, without a new publish: from an engine
that applied it, else from the sender's retained copy (``--retain-mb``), else it says why it
waits and takes the next version.

Every part is a real process but the publisher: the ``weightsync-sender`` CLI and each
receiver (``tests.support.processes``). A version is four 1 MiB buckets (``fault_model``).
After each publish the trainer's tensors change in place, as training changes them: a
catch-up that read the trainer's memory would apply the wrong bytes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import pytest
import torch

from tests.support.models import digests, step
from tests.support.processes import (
    SyncThread,
    fault_model,
    kill_receiver,
    next_outcomes,
    sender_process,
    start_receivers,
    stop_children,
    unix_sender,
)
from tests.support.waiting import wait_until
from weightsync.errors import ReceiverFailedError
from weightsync.receiver import ReceiverCore, TorchReceiver
from weightsync.receiver.target import InPlaceTarget
from weightsync.sender import Publisher
from weightsync.topology_model import Box


class Job:
    """A sender process, receiver processes, and an in-process trainer that publishes."""

    def __init__(self, sock_dir: str, env: dict[str, str] | None = None) -> None:
        self.address = f"unix:{sock_dir}/s.sock"
        self.sender = sender_process(self.address, env)
        self.publisher = Publisher(self.address)
        self.trainer = fault_model(0)
        self.expected: dict[int, dict[str, str]] = {}
        self.procs: dict[str, object] = {}
        self.out = None

    def start(self, *rids: str, syncs: int = 3, env: dict | None = None) -> None:
        procs, self.out = start_receivers(
            self.address, list(rids), syncs, model_of=fault_model, out=self.out, env=env
        )
        self.procs.update(zip(rids, procs, strict=True))

    def publish(self, version: int) -> None:
        step(self.trainer, version)
        self.publisher.publish(self.trainer.state_dict(), version, wait=True, timeout_s=60)
        self.expected[version] = digests(self.trainer)
        step(self.trainer, 10_000 + version)  # training goes on in place: not a source now

    def outcomes(self, count: int):
        try:
            return next_outcomes(self.out, count)
        except AssertionError as e:  # say what the sender saw, to tell why
            status = self.publisher.status()
            seen = [
                (r.receiver_id, r.state, r.applied_version, r.catch_up) for r in status.receivers
            ]
            ups = [(c.receiver_id, c.source, c.state, c.error.message) for c in status.catch_ups]
            raise AssertionError(f"{e}; the sender's receivers {seen}, catch-ups {ups}") from None

    def kill(self, rid: str) -> None:
        kill_receiver(self.procs.pop(rid), self.out)

    def restarted(self, rid: str) -> None:
        """``rid``, the job's only engine, applies version 1, is killed and started again."""
        self.start(rid)
        self.publish(1)
        _applied(self, *self.outcomes(1), 1)
        self.kill(rid)
        self.start(rid)

    def catch_ups(self):
        return list(self.publisher.status().catch_ups)

    def receiver(self, rid: str):
        return next(r for r in self.publisher.status().receivers if r.receiver_id == rid)

    def close(self) -> None:
        self.publisher.close()
        stop_children(list(self.procs.values()), [self.sender])


@pytest.fixture
def job(sock_dir):
    made: list[Job] = []

    def make(env: dict[str, str] | None = None) -> Job:
        made.append(Job(sock_dir, env))
        return made[-1]

    yield make
    for j in made:
        j.close()


def _applied(job: Job, outcome, version: int) -> None:
    assert (outcome.state, outcome.version) == ("applied", version), outcome.error
    assert outcome.digests == job.expected[version], f"{outcome.receiver_id} differs"


def test_a_late_receiver_catches_up_from_a_peer_engine(job):
    j = job()
    j.start("r0")
    j.publish(1)
    (first,) = j.outcomes(1)
    _applied(j, first, 1)
    j.start("late")
    (caught,) = j.outcomes(1)
    _applied(j, caught, 1)
    (record,) = j.catch_ups()
    assert (record.receiver_id, record.version, record.source, record.route, record.state) == (
        "late",
        1,
        "receiver r0",
        "host",
        "complete",
    )
    assert record.bytes == sum(
        t.numel() * t.element_size() for t in j.trainer.state_dict().values()
    )
    assert record.complete_s > 0
    table = subprocess.run(
        [f"{os.path.dirname(sys.executable)}/weightsync", "status", "--address", j.address],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    assert "catch-ups" in table, table
    assert re.search(r"late\s+│?\s*1\s+│?\s*receiver r0\s+│?\s*host\s+│?\s*complete", table), table
    j.publish(2)
    for outcome in j.outcomes(2):
        _applied(j, outcome, 2)


def test_a_receiver_killed_and_restarted_under_its_id_catches_up(job):
    j = job()
    j.start("r0", "r1")
    j.publish(1)
    for outcome in j.outcomes(2):
        _applied(j, outcome, 1)
    j.kill("r1")
    j.start("r1")
    (caught,) = j.outcomes(1)
    assert caught.receiver_id == "r1"
    _applied(j, caught, 1)
    assert [(c.receiver_id, c.source) for c in j.catch_ups()] == [("r1", "receiver r0")]
    j.publish(2)
    for outcome in j.outcomes(2):
        _applied(j, outcome, 2)


def test_a_catch_up_racing_a_new_version_applies_each_exactly(job):
    """The late receiver registers while the next version is being published: it applies the
    catch-up and then that version, or that version alone, each bit-exact; never a mix."""
    j = job()
    j.start("r0", syncs=4)
    j.publish(1)
    _applied(j, *j.outcomes(1), 1)
    racing = threading.Thread(target=j.publish, args=(2,))
    racing.start()
    j.start("late", syncs=4)
    racing.join(60)
    got = j.outcomes(2)
    late = [o for o in got if o.receiver_id == "late"]
    _applied(j, next(o for o in got if o.receiver_id == "r0"), 2)
    if late[0].version == 1:  # it caught up before version 2 reached it
        _applied(j, late[0], 1)
        (late2,) = j.outcomes(1)
        _applied(j, late2, 2)
    else:
        _applied(j, late[0], 2)
    j.publish(3)
    for outcome in j.outcomes(2):
        _applied(j, outcome, 3)


def test_with_no_engine_holding_the_version_and_nothing_retained_it_waits_saying_why(job):
    """The job's only engine restarts: nobody holds version 1, the sender retains nothing."""
    j = job()
    j.restarted("only")
    wait_until(lambda: j.receiver("only").catch_up, 30, "the restarted receiver's catch_up")
    assert j.receiver("only").catch_up == (
        "waits for the next version: no receivers that applied version 1 can hand it out "
        "together (none said `exports`, or what they keep does not cover every tensor) and the "
        "sender retains no copy of it (weightsync-sender --retain-mb)"
    )
    assert j.catch_ups() == []
    j.publish(2)
    (outcome,) = j.outcomes(1)
    _applied(j, outcome, 2)  # its first version: nothing came before the next publish
    assert j.receiver("only").catch_up == ""


def test_with_retain_the_sender_is_the_source_when_no_engine_holds_the_version(job):
    j = job({"WEIGHTSYNC_RETAIN_BYTES": str(8 << 20)})
    j.restarted("only")
    (caught,) = j.outcomes(1)
    _applied(j, caught, 1)
    assert [(c.receiver_id, c.source, c.route, c.state) for c in j.catch_ups()] == [
        ("only", "retained", "retained", "complete")
    ]
    j.publish(2)
    _applied(j, *j.outcomes(1), 2)


def test_a_version_larger_than_retain_is_not_retained(job):
    j = job({"WEIGHTSYNC_RETAIN_BYTES": str(1 << 20)})  # the version is 3.8 MB
    j.restarted("only")
    wait_until(lambda: j.receiver("only").catch_up, 30, "the restarted receiver's catch_up")
    assert "retains no copy" in j.receiver("only").catch_up


@pytest.mark.parametrize("source", ["peer", "retained"])
def test_a_late_receiver_on_another_host_catches_up_by_broadcast(job, source):
    """It gets buckets by broadcast (gloo on CPU): the source packs them into the sender's
    staging buffer (a receiver on the sender's host, or the retained copy), the sender
    broadcasts them to it alone."""
    j = job({"WEIGHTSYNC_RETAIN_BYTES": str(8 << 20)} if source == "retained" else None)
    j.start("r0")
    j.publish(1)
    _applied(j, *j.outcomes(1), 1)
    if source == "retained":
        j.kill("r0")
    j.start("remote", env={"remote": {"WEIGHTSYNC_HOST_ID": "another-host"}})
    (caught,) = j.outcomes(1)
    _applied(j, caught, 1)
    assert j.receiver("remote").data_path == "broadcast"
    (record,) = j.catch_ups()
    assert (record.receiver_id, record.state) == ("remote", "complete")
    assert record.source == ("receiver r0" if source == "peer" else "retained")


class RowHalf(InPlaceTarget):
    """An engine TP rank's shard: rank 0 keeps the first half of the rows of every 2-D tensor,
    rank 1 the second; every other tensor whole. Holds only that (its live tensors are the
    halves), as a TP engine does."""

    chunks_in_place = False  # whole tensors arrive: it takes its rows of each

    def __init__(self, model: torch.nn.Module, rank: int) -> None:
        full = model.state_dict()
        self.boxes = {}
        for name, t in full.items():
            if t.dim() == 2:
                half = t.shape[0] // 2
                self.boxes[name] = Box((rank * half, 0), (half, t.shape[1]))
        self.live = {n: self._mine(n, t).clone() for n, t in full.items()}
        self.device = torch.device("cpu")

    def _mine(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        box = self.boxes.get(name)
        return tensor if box is None else tensor[box.start[0] : box.stop[0]]

    def keeps(self) -> dict[str, Box]:
        return self.boxes

    def validate(self, manifest) -> None:
        missing = [t.name for t in manifest.tensors if t.name not in self.live]
        assert not missing, missing

    def live_tensor(self, name: str) -> torch.Tensor:
        return self.live[name]

    def copy_pairs(self, tensors):
        return [(self.live[name], self._mine(name, t)) for name, t in tensors]


def _applied_by(receivers, publisher, trainer) -> dict[str, str]:
    """Version 1 published and applied by ``receivers``; then the trainer's tensors change (its
    memory is no source). Returns version 1's digests."""
    threads = [SyncThread(r, 1) for r in receivers]
    for t in threads:
        t.start()
    step(trainer, 1)
    publisher.publish(trainer.state_dict(), 1, wait=True, timeout_s=60)
    want = digests(trainer)
    assert [t.finish() for t in threads] == [[1]] * len(receivers)
    step(trainer, 10_001)
    return want


def test_a_late_receiver_catches_up_from_engine_ranks_that_each_keep_a_shard(sock_dir):
    """Two engine TP ranks, each holding half of every matrix, are the sources together: each
    writes its half of each bucket; the late receiver, holding everything, gets it whole."""
    trainer = fault_model(0)
    with unix_sender(bucket_size_bytes=1 << 20) as sender:
        ranks = [
            ReceiverCore(RowHalf(fault_model(5), r), sender.address, receiver_id=f"tp{r}")
            for r in (0, 1)
        ]
        publisher = Publisher(sender.address)
        want = _applied_by(ranks, publisher, trainer)
        late_model = fault_model(6)
        late = TorchReceiver(late_model, sender.address, receiver_id="late")
        assert late.sync(timeout=60) == 1
        assert digests(late_model) == want
        (record,) = publisher.status().catch_ups
        assert (record.source, record.route, record.state) == (
            "receivers tp0, tp1",
            "host",
            "complete",
        )
        for r in (*ranks, late, publisher):
            r.close()


def test_a_source_that_hands_out_other_bytes_fails_and_the_next_source_is_taken(sock_dir):
    """Planted fault: engine "a" hands out one tensor (``norm``) plus one. The catch-up's
    checksums differ from the version as published, so the late receiver is told to abort
    it (never reported applied); the next source, engine "b", catches it up bit-exact."""
    trainer = fault_model(0)
    with unix_sender(bucket_size_bytes=1 << 20) as sender:
        models = {rid: fault_model(7) for rid in ("a", "b")}
        holders = {
            rid: TorchReceiver(m, sender.address, receiver_id=rid) for rid, m in models.items()
        }
        publisher = Publisher(sender.address)
        want = _applied_by(list(holders.values()), publisher, trainer)
        target = holders["a"].target
        honest = target.held
        target.held = lambda name: honest(name) + (1 if name == "norm" else 0)
        late_model = fault_model(8)
        late = TorchReceiver(late_model, sender.address, receiver_id="late")
        with pytest.raises(ReceiverFailedError, match="differs from the version as published"):
            late.sync(timeout=60)
        assert late.sync(timeout=60) == 1
        assert digests(late_model) == want
        first, second = publisher.status().catch_ups
        assert (first.source, first.state) == ("receiver a", "failed")
        assert "from its source (holding 'embed', 'proj', 'norm' and 2 more) differs from " in (
            first.error.message
        )
        assert (second.source, second.state) == ("receiver b", "complete")
        for r in (*holders.values(), late, publisher):
            r.close()
