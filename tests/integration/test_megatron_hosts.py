"""Issue 12: a Megatron trainer spanning hosts publishes through one sender per host into
receivers on other hosts; a sender killed mid-version fails it on every receiver, naming that
sender, before any write, and after it restarts the next version applies everywhere.

Every part is real and its own process: megatron-core ranks on CPU over gloo (PP=2, or EP=2
MoE), rank r on trainer host ``HOSTS[r]``; one ``weightsync-sender`` CLI per trainer host;
two receiver processes (``TorchReceiver(model, [a, b])``) on hosts "engine-a" and "engine-b".

The four hosts are host ids (``WEIGHTSYNC_HOST_ID``), not network namespaces: one machine,
one network. What a host id changes is the data path, the part under test: a receiver on
another host than its sender gets the bytes by broadcast over gloo (one private group per
sender, TCP on loopback here), as across machines, never by mapping the sender's shm. A
receiver in its own namespace is in ``test_netns.py``.

Checked: each sender's part (disjoint, together every HF tensor, one digest), every
receiver's weights after each version bit for bit against the offline conversion, and the
kill: no receiver writes or commits the version, every one fails it naming the sender, each
trainer rank gets its exact error, and the next version heals.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from tests.support import children, holder_module
from tests.support import megatron as ms
from tests.support.models import digests
from tests.support.processes import (
    Inbox,
    Outcome,
    Reporter,
    fault_reports,
    sender_process,
    stop_children,
)
from tests.support.waiting import wait_until

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.megatron

HOSTS = ["trainer-a", "trainer-b"]
ENGINES = ["engine-a", "engine-b"]
VERSIONS = 3
"""Applied everywhere before the kill."""
KILLED = VERSIONS + 1
"""The version in flight when trainer-a's sender is killed."""
HEALED = KILLED + 1
"""The version published once it restarted."""
WAIT_S = 300
LAYOUTS = {
    # one pipeline stage per host
    "pp2": ({"tp": 1, "pp": 2}, "llama_mqa_tied"),
    # one expert-parallel rank per host; dense layers are data-parallel: on both hosts
    "ep2": ({"tp": 1, "pp": 1, "ep": 2}, "qwen3_moe"),
}


def holders(name: str, layout: str) -> set[str]:
    """The hosts whose ranks hold ``name`` in the layouts above (4 layers, 4 experts)."""
    if layout == "pp2":
        if name.startswith("model.layers."):
            return {HOSTS[int(name.split(".")[2]) >= 2]}
        return {HOSTS[name != "model.embed_tokens.weight"]}
    if ".mlp.experts." in name:
        return {HOSTS[int(name.split(".")[5]) >= 2]}
    return set(HOSTS)


def publish_through_a_kill_worker(
    rank: int, sizes: dict, case_name: str, addresses: dict, reports: str, gates: dict
):
    """Publish versions 1 to ``HEALED`` (``stand_in_step`` between them) to this host's sender,
    reporting each (``published`` or the error's type name). Version 1 waits for
    ``gates["go"]``, ``HEALED`` for ``gates["resume"]``; in ``KILLED`` no bucket is packed
    until ``gates["release"]`` (reported as ``holding``), so the test kills a sender while the
    version is in flight and before any byte of it was sent. Rank 0 returns each host's part
    (its ``VersionPartSpec`` and tensors) and each version's gathered shards."""
    from weightsync.errors import WeightSyncError
    from weightsync.sender.megatron import MegatronPublisher, collect_shards, gather_local_shards

    out, who = Reporter(reports), f"rank-{HOSTS[rank]}"
    case = ms.CASE_BY_NAME[case_name]
    torch.manual_seed(0)
    chunks = ms.build_chunks(case, sizes)
    ms.fill_by_global_name(chunks, case)
    publisher = MegatronPublisher(chunks, ms.hf_config(case), addresses, host_id=HOSTS[rank])
    publish_packed = publisher.publisher.publish_packed

    def held_publish_packed(manifest, pack, **kwargs):
        def pack_once_released(bucket, buffer):
            if not gates["release"].is_set():
                out.put(Outcome(who, "holding", manifest.version, {}, ""))
                assert gates["release"].wait(WAIT_S), f"{who}: never released"
            pack(bucket, buffer)

        return publish_packed(manifest, pack_once_released, **kwargs)

    states = []
    for version in range(1, HEALED + 1):
        if version > 1:
            ms.stand_in_step(chunks)
        gate = {1: "go", HEALED: "resume"}.get(version)
        if gate:
            assert gates[gate].wait(WAIT_S), f"{who}: version {version} never let go"
        publisher.publisher.publish_packed = (
            held_publish_packed if version == KILLED else publish_packed
        )
        try:
            publisher.publish(version, wait=True, timeout_s=WAIT_S)
            out.put(Outcome(who, "published", version, {}, ""))
        except WeightSyncError as e:
            out.put(Outcome(who, type(e).__name__, version, {}, str(e)))
        states.append(gather_local_shards(collect_shards(chunks)))
    publisher.close()
    parts = {h: (publisher.parts.part_of(h), publisher.parts.tensors_of(h)) for h in HOSTS}
    return (parts, states) if rank == 0 else None


class Hosts:
    """The senders (one per trainer host), the receivers on the engine hosts, and the trainer
    ranks (``publish_through_a_kill_worker``, launched from a thread of the test)."""

    def __init__(self, sock_dir: str) -> None:
        self.addresses = {h: f"unix:{sock_dir}/{h}.sock" for h in HOSTS}
        self.out = fault_reports(f"{sock_dir}/reports.sock")
        self.inbox = Inbox(self.out)
        self.gates = {name: children.event() for name in ("go", "release", "resume")}
        self.senders: dict = {}
        self.killed: list = []
        self.receivers: list = []
        self.trainer: threading.Thread | None = None
        self.result: dict = {}
        self.layout = ""

    def start(self, tmp_path, layout: str) -> None:
        """The senders, then the receivers and the trainer ranks together (each takes seconds
        to import); the ranks publish once every receiver registered."""
        self.layout = layout
        sizes, case_name = LAYOUTS[layout]
        for host in HOSTS:  # one by one: close() ends those started before a failure
            self.senders[host] = self.start_sender(host)
        self.receivers = [
            ms.start_receiver(list(self.addresses.values()), rid, case_name, rid, self.out)
            for rid in ENGINES
        ]
        args = (sizes, publish_through_a_kill_worker, case_name, self.addresses, self.out.path)

        def train() -> None:
            try:
                self.result.update(ms.launch(tmp_path, *args, self.gates))
            except BaseException as e:  # re-raised by trained()
                self.result["error"] = e

        self.trainer = threading.Thread(target=train, daemon=True)
        self.trainer.start()
        self.wait_all("ready", 0)
        self.gates["go"].set()

    def start_sender(self, host: str):
        return sender_process(self.addresses[host], {"WEIGHTSYNC_HOST_ID": host})

    def wait_all(self, state: str, version: int, who: list[str] = ENGINES) -> None:
        """Until each of ``who`` reported ``state`` for ``version``."""
        self.inbox.wait(
            lambda seen: self.alive() and all(self.inbox.find(w, state, version) for w in who),
            WAIT_S,
            f"not every one of {who} reported {state} {version}",
        )

    def ended(self, who: str, version: int) -> Outcome:
        """How ``who`` ended ``version``: its first report other than ``began`` / ``holding``."""
        return self.inbox.wait(
            lambda seen: (
                self.alive()
                and next(
                    (
                        o
                        for _, o in seen
                        if (o.receiver_id, o.version) == (who, version)
                        and o.state not in ("began", "holding")
                    ),
                    None,
                )
            ),
            WAIT_S,
            f"{who} did not end version {version}",
        )

    def alive(self) -> bool:
        """True; a receiver process that exited fails the wait at once."""
        exits = {rid: p.exitcode for rid, p in zip(ENGINES, self.receivers, strict=True)}
        assert not any(code is not None for code in exits.values()), f"exit codes: {exits}"
        return True

    def trained(self):
        """What rank 0 returned, once every rank ended.

        Raises:
            AssertionError: the ranks did not end, or failed (with their tracebacks).
        """
        self.trainer.join(WAIT_S)
        assert not self.trainer.is_alive(), "the trainer ranks did not end"
        if "error" in self.result:
            raise self.result["error"]
        return self.result[0]

    def status(self, host: str):
        from weightsync.sender import Publisher

        with Publisher(self.addresses[host], connect_timeout_s=30) as client:
            return client.status()

    def kill(self, host: str) -> None:
        victim = self.senders.pop(host)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(30)
        self.killed.append(victim)

    def close(self) -> None:
        # Ranks left waiting (a failed test) go on, and fail without their senders.
        for gate in self.gates.values():
            gate.set()
        stop_children(self.receivers, [*self.senders.values(), *self.killed])
        if self.trainer is not None:
            self.trainer.join(WAIT_S)
        self.out.close()


@pytest.fixture
def hosts(request, sock_dir, tmp_path):
    rig = Hosts(sock_dir)
    try:
        rig.start(tmp_path, request.param)
        yield rig
    finally:
        rig.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("hosts", list(LAYOUTS), indirect=True)
def test_a_trainer_spanning_hosts_publishes_a_part_per_host_and_heals_a_killed_sender(
    hosts,
):
    from weightsync.manifest import plan_digest
    from weightsync.sender.megatron import convert_megatron_to_hf, hf_manifest

    layout = hosts.layout
    config = ms.hf_config(ms.CASES[LAYOUTS[layout][1]])
    everything = hf_manifest(config, "float32")
    victim, survivor = HOSTS
    ranks = [f"rank-{h}" for h in HOSTS]
    for version in range(1, VERSIONS + 1):
        for rank in ranks:
            assert hosts.ended(rank, version).state == "published", hosts.ended(rank, version)
        hosts.wait_all("applied", version)
    # KILLED is in flight: both senders announced it, every receiver joined the parts and
    # began, and no rank packed a bucket. Now the victim's sender dies.
    hosts.wait_all("holding", KILLED, ranks)
    hosts.wait_all("began", KILLED)
    before = {h: hosts.status(h) for h in HOSTS}
    hosts.kill(victim)
    # Every receiver's part from the victim has failed before the survivor packs a byte: the
    # survivor's buckets are then only passed through, never written.
    hosts.wait_all("lost", 0)
    hosts.gates["release"].set()
    failed = {rid: hosts.ended(rid, KILLED) for rid in ENGINES}
    published = {rank: hosts.ended(rank, KILLED) for rank in ranks}
    # The victim restarts on the same address; the receivers register again; the next version.
    hosts.senders[victim] = hosts.start_sender(victim)
    wait_until(
        lambda: (
            {r.receiver_id: r.data_path for r in hosts.status(victim).receivers if r.connected}
            == dict.fromkeys(ENGINES, "broadcast")
        ),
        WAIT_S,
        f"the receivers did not register again with {victim}'s restarted sender",
    )
    hosts.gates["resume"].set()
    for rank in ranks:
        assert hosts.ended(rank, HEALED).state == "published", hosts.ended(rank, HEALED)
    hosts.wait_all("applied", HEALED)
    after = {h: hosts.status(h) for h in HOSTS}
    parts, states = hosts.trained()

    # Each sender's part: its host's, disjoint from the other, together every HF tensor.
    names = {h: [s.name for s in parts[h][1]] for h in HOSTS}
    for index, host in enumerate(HOSTS):
        part, _ = parts[host]
        assert (part.index, part.count, part.sender_id) == (index, 2, host)
        assert part.num_tensors == len(everything)
        assert all(host in holders(n, layout) for n in names[host]), (host, names[host])
        # What the sender announced, version after version, from its host's one rank.
        versions = {v.version: v for v in before[host].versions}
        assert sorted(versions) == list(range(1, KILLED + 1)), host
        for version in range(1, VERSIONS + 1):
            assert versions[version].state == "complete", (host, version)
            assert versions[version].num_tensors == len(names[host]), (host, version)
            assert versions[version].total_bytes == sum(s.nbytes for s in parts[host][1])
        assert [(p.ranks_connected, p.world_size) for p in before[host].publishers] == [(1, 1)]
        assert {r.receiver_id: r.data_path for r in before[host].receivers} == dict.fromkeys(
            ENGINES, "broadcast"
        ), host
    assert not set(names[victim]) & set(names[survivor])
    assert sorted(names[victim] + names[survivor]) == sorted(s.name for s in everything)
    assert {parts[h][0].plan_digest for h in HOSTS} == {plan_digest([parts[h][1] for h in HOSTS])}
    if layout == "ep2":
        # Both hosts hold the dense layers (data parallel): the bytes are balanced over them.
        sent = [sum(s.nbytes for s in parts[h][1]) for h in HOSTS]
        assert abs(sent[0] - sent[1]) <= max(s.nbytes for s in everything), sent
        assert all(any(".experts." not in n for n in names[h]) for h in HOSTS)

    # Every receiver holds each version bit for bit, the killed one excepted.
    want = {}
    for version, state in enumerate(states, start=1):
        converted = convert_megatron_to_hf(state, config)
        assert sorted(converted) == sorted(s.name for s in everything)
        want[version] = digests(holder_module(converted))

    def held(outcome: Outcome) -> dict[str, str]:
        return {name: outcome.digests[name] for name in want[1]}

    for version in [*range(1, VERSIONS + 1), HEALED]:
        for rid in ENGINES:
            ((_, applied),) = hosts.inbox.find(rid, "applied", version)
            assert held(applied) == want[version], f"{rid} differs from version {version}"
    # The killed version: no receiver committed or wrote it, each one names the sender.
    for rid, outcome in failed.items():
        assert outcome.state == "TransportError", outcome.error
        assert outcome.error.startswith(
            f"version {KILLED} failed on receiver {rid}: part 0 of 2 from sender {victim} at "
            f"{hosts.addresses[victim]}: "
        ), outcome.error
        assert "dirty" not in outcome.error, outcome.error
        assert held(outcome) == want[VERSIONS], f"{rid} changed weights in version {KILLED}"
        assert not hosts.inbox.find(rid, "applied", KILLED), f"{rid} applied version {KILLED}"
    # Each trainer rank hears it: the victim's from its dead sender, the survivor's from the
    # receivers through its own sender.
    assert published[f"rank-{victim}"].state == "TransportError", published[f"rank-{victim}"]
    assert hosts.addresses[victim] in published[f"rank-{victim}"].error
    survived = published[f"rank-{survivor}"]
    assert survived.state == "ReceiverFailedError", survived
    assert survived.error.startswith(f"version {KILLED} failed on 2 receiver(s): "), survived
    for rid in ENGINES:
        assert f"{rid}: TransportError: version {KILLED} failed on receiver {rid}: part 0 " in (
            survived.error
        ), survived.error
    # The survivor's sender failed the killed version and sent the healed one; the victim's
    # restarted sender knows only the healed one.
    assert [(v.version, v.state) for v in after[survivor].versions] == [
        *((v, "complete") for v in range(1, VERSIONS + 1)),
        (KILLED, "failed"),
        (HEALED, "complete"),
    ]
    assert [(v.version, v.state) for v in after[victim].versions] == [(HEALED, "complete")]


def tp_across_hosts_worker(rank: int, sizes: dict, case_name: str):
    """Construct the publisher with each TP rank claiming its own host; returns what it raised."""
    from weightsync.sender.megatron import MegatronPublisher

    case = ms.CASES[case_name]
    chunks = ms.build_chunks(case, sizes)
    try:
        # No sender: the plan is refused before any connection is tried.
        MegatronPublisher(
            chunks, ms.hf_config(case), "unix:/nonexistent/s.sock", host_id=HOSTS[rank]
        )
    except Exception as e:  # the assertion compares what every rank raised
        return type(e).__name__, str(e)
    return "nothing raised", ""


def test_a_tp_group_spanning_hosts_is_refused_on_every_rank(tmp_path):
    results = ms.launch(tmp_path, {"tp": 2, "pp": 1}, tp_across_hosts_worker, "qwen2_bias")
    assert sorted(results) == [0, 1]
    assert results[0] == results[1], results
    kind, message = results[0]
    assert kind == "PlanError", message
    assert "TP groups must stay within a host" in message
    assert "hosts trainer-a, trainer-b" in message
    assert "HF tensor 'model.embed_tokens.weight'" in message
