"""``weightsync.integrations.ray`` on a local two-node Ray cluster.

``ray.cluster_utils.Cluster`` starts two Ray nodes on this machine (a head and a worker
raylet, 1 CPU and a 100 MB object store each), each with its own node id: to Ray and to
``SenderActors`` they are two nodes. Senders, trainer and rollout workers are real Ray
actors in their own processes, moving versions through real senders. The sample in
docs/ray.md is what runs (its three ``python`` blocks, executed as written): a sender per
node, each node's engine bit-exact with its node's trainer; then a version split over both
nodes' senders into engines registered with both. Also: a sender that cannot start (its
node named, the others stopped), the token handed to TCP senders (and absent from Ray's
files), senders closed when their handles go.

What a local cluster cannot show: separate hosts (both nodes share one host id, so an
engine maps the other node's staging shm where on another host it would get a broadcast),
GPUs.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support import TinyNet, digests, step, wait_until
from weightsync.buckets import TensorSpec
from weightsync.errors import ConfigError
from weightsync.manifest import VersionPartSpec, plan_digest
from weightsync.transports.shm import SHM_DIR, owner_key

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'weightsync[ray]')")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import (  # noqa: E402
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from weightsync.integrations.ray import SenderActors  # noqa: E402
from weightsync.receiver import TorchReceiver  # noqa: E402
from weightsync.sender import Publisher, Sender  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs/ray.md"
NODES = 2
OBJECT_STORE_BYTES = 100 * 1024 * 1024
CLUSTER_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage report attempts (no network here)
    "WEIGHTSYNC_BUCKET_SIZE_BYTES": "4096",  # a node's own settings: small staging, chunking
    "WEIGHTSYNC_ACK_TIMEOUT_S": "30",
    # Ray's GCS starts in about 5 s on an idle box, 10 s with both cores busy; Ray waits 30 s
    # by default, and a cold CI run beside the vLLM sweep once ran out of it.
    "RAY_gcs_server_port_wait_time_s": "90",
}
"""Set for the cluster's processes, which inherit this process's environment."""
CLUSTER_NODE = {"num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES}
"""Each of the two nodes."""

START_ATTEMPTS = 2
"""Twice on the 2-core CI box (2026-11-28 and -29) Ray's GCS server wrote nothing, not even
its log, within the wait: a GCS that never came up, which no longer wait cures. A cluster
that fails to start is torn down and started once more in a fresh directory; the first
failure is reported as a warning, two fail the tests with both reports."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with pytest.MonkeyPatch.context() as env:
        for k, v in CLUSTER_ENV.items():
            env.setenv(k, v)
        # Workers import this module: functions handed to actors are pickled by reference.
        env.setenv("PYTHONPATH", str(ROOT), prepend=os.pathsep)
        c, temp = _start_head(env)
        try:
            try:
                for _ in range(NODES - 1):
                    c.add_node(**CLUSTER_NODE)
                ray.init(address=c.address, log_to_driver=False)
                yield c
            finally:
                ray.shutdown()
                c.shutdown()
        finally:
            shutil.rmtree(temp, ignore_errors=True)


def _start_head(env: pytest.MonkeyPatch) -> tuple[Cluster, str]:
    """A cluster with its head node started, and the directory holding Ray's files."""
    failures = []
    for _ in range(START_ATTEMPTS):
        # Ray's files (sessions, logs, sockets) in a short directory of the test's own.
        temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        env.setenv("RAY_TMPDIR", temp)
        try:
            head = {**CLUSTER_NODE, "include_dashboard": False}
            return Cluster(initialize_head=True, head_node_args=head), temp
        except RuntimeError as e:
            failures.append(f"{e}\n{_ray_logs(temp)}\n{_kill_ray_processes(temp)}")
            shutil.rmtree(temp, ignore_errors=True)
            if len(failures) < START_ATTEMPTS:
                message = f"Ray's head node did not start; once more:\n{failures[-1]}"
                warnings.warn(message, stacklevel=2)
    raise RuntimeError("\n\n".join(failures))


def _ray_logs(temp: str, lines: int = 20) -> str:
    """The last ``lines`` of each of Ray's GCS and raylet logs under ``temp``: why a cluster
    did not start."""
    out = []
    for path in sorted(Path(temp).glob("ray/session_2*/logs/*")):  # not session_latest
        if path.name.startswith(("gcs_server", "raylet")) and path.is_file():
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
    return "\n".join(out) or f"(no Ray logs under {temp})"


def _kill_ray_processes(temp: str) -> str:
    """Kill Ray's processes started for ``temp`` (their command lines name it), so that a
    failed start leaves nothing running; returns each one's state as it was."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "status", "cmdline"]):
        if any(temp in arg for arg in proc.info["cmdline"] or ()):
            found.append(f"{proc.info['name']} (pid {proc.info['pid']}): {proc.info['status']}")
            with contextlib.suppress(psutil.Error):
                proc.kill()
    return "Ray's processes: " + ("; ".join(found) or f"none names {temp}")


@pytest.fixture
def pg(cluster: Cluster) -> Iterator[Any]:
    group = placement_group([{"CPU": 1}] * NODES, strategy="STRICT_SPREAD")
    yield group
    remove_placement_group(group)  # kills what was placed in it


def doc_blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert len(blocks) == 3, "docs/ray.md: expected the setup, per-step and shutdown blocks"
    return blocks


def node_step(model: Any, version: int) -> None:
    """The docs' ``train_step``: a different step on every node, so that a receiver that read
    another node's sender would hold other weights."""
    node = ray.get_runtime_context().get_node_id()
    step(model, seed=version * 1000 + int(node[:6], 16))


def placed(worker: Any) -> tuple[str, str]:
    """(node id, sender address) of a docs worker, from inside it."""
    client = getattr(worker, "publisher", None) or worker.receiver
    return ray.get_runtime_context().get_node_id(), client.address


def model_digests(worker: Any) -> dict[str, str]:
    return digests(worker.model)


SPLIT = (("embed",), ("proj", "norm", "counts", "scale"))
"""The TinyNet tensors each node's sender sends of a split version."""


def register_with_every_sender(worker: Any, addresses: list[str]) -> None:
    """A docs rollout worker's receiver, registered with every sender instead of its own."""
    worker.receiver.close()
    worker.receiver = TorchReceiver(worker.model, addresses)


def publish_part(worker: Any, version: int, index: int) -> dict[str, str]:
    """A docs trainer worker publishes its part ``index`` of ``version``; returns the digests
    of what it sent."""
    state = worker.model.state_dict()
    specs = [[TensorSpec.of(n, state[n]) for n in names] for names in SPLIT]
    node = ray.get_runtime_context().get_node_id()
    part = VersionPartSpec(index, len(SPLIT), node, plan_digest(specs), len(state))
    worker.publisher.publish({n: state[n] for n in SPLIT[index]}, version, wait=True, part=part)
    return {n: d for n, d in digests(worker.model).items() if n in SPLIT[index]}


def shm_segments(address: str) -> list[str]:
    return glob.glob(os.path.join(SHM_DIR, f"weightsync-{owner_key(address)}-*"))


def test_docs_sample_one_sender_per_node_bit_exact(cluster: Cluster) -> None:
    setup, per_step, shutdown = doc_blocks()
    ns: dict[str, Any] = {
        "__name__": "docs_ray",
        "num_nodes": NODES,
        "make_model": TinyNet,
        "train_step": node_step,
    }
    try:
        run_docs_sample(setup, per_step, shutdown, ns)
    finally:
        if "senders" in ns:
            ns["senders"].shutdown()  # idempotent; a failed test leaves no socket behind
        if "pg" in ns:
            remove_placement_group(ns["pg"])


def run_docs_sample(setup: str, per_step: str, shutdown: str, ns: dict[str, Any]) -> None:
    exec(setup, ns)
    senders: SenderActors = ns["senders"]
    bundle_nodes = placement_group_table(ns["pg"])["bundles_to_node_id"]
    assert len(set(bundle_nodes.values())) == NODES
    # Each sender's node as its actor saw it: the node of its bundle, one sender per node.
    assert [(s.bundle_index, s.node_id) for s in senders.senders] == sorted(bundle_nodes.items())
    addresses = senders.addresses()
    assert addresses == {n: f"unix:/tmp/weightsync-{n}.sock" for n in bundle_nodes.values()}
    with pytest.raises(ConfigError, match=f"no weightsync sender on node {'0' * 56}"):
        senders.address_for("0" * 56)
    for i, worker in enumerate(ns["trainers"] + ns["rollouts"]):
        node = bundle_nodes[i % NODES]
        assert ray.get(worker.__ray_call__.remote(placed)) == (node, addresses[node])

    for version in (1, 2):
        exec(per_step, {**ns, "version": version})
        sent = ray.get([t.__ray_call__.remote(model_digests) for t in ns["trainers"]])
        got = ray.get([r.__ray_call__.remote(model_digests) for r in ns["rollouts"]])
        assert got == sent, f"version {version}: an engine's weights differ from its node's"
        assert sent[0] != sent[1], "both nodes trained alike: the check above proves nothing"

    # Version 3 split over both nodes' senders: each node's trainer publishes its share, and
    # every engine, now registered with both senders, applies the whole.
    every = list(addresses.values())
    ray.get([r.__ray_call__.remote(register_with_every_sender, every) for r in ns["rollouts"]])
    syncs = [r.sync.remote() for r in ns["rollouts"]]
    parts = ray.get(
        [t.__ray_call__.remote(publish_part, 3, i) for i, t in enumerate(ns["trainers"])]
    )
    assert ray.get(syncs) == [3] * NODES
    whole = {**parts[0], **parts[1]}
    assert whole not in sent, "one node's weights: the other part was not needed"
    assert (
        ray.get([r.__ray_call__.remote(model_digests) for r in ns["rollouts"]]) == [whole] * NODES
    )

    staged = {a: shm_segments(a) for a in addresses.values()}
    assert all(staged.values()), f"no staging shm to check the cleanup against: {staged}"
    exec(shutdown, ns)
    for address in addresses.values():
        assert not os.path.exists(address.removeprefix("unix:")), f"{address} left behind"
        assert shm_segments(address) == [], f"{address}: staging shm left behind"
    senders.shutdown()  # idempotent


def test_a_sender_that_cannot_start_names_its_node(pg: Any, sock_dir: str) -> None:
    ray.get(pg.ready())
    node_a, node_b = (placement_group_table(pg)["bundles_to_node_id"][i] for i in range(NODES))
    listen = f"unix:{sock_dir}/{{node_id}}.sock"
    with pytest.raises(ConfigError, match=f"node {node_a} \\(placement group bundle 0\\)"):
        SenderActors.start(pg, listen=listen, actor_options={"num_cpus": 2})  # Ray refuses
    # Another process already listens where node B's sender would.
    with Sender(listen.format(node_id=node_b)) as squatter:
        with pytest.raises(ConfigError) as failed:
            SenderActors.start(pg, listen=listen)
        message = str(failed.value)
        assert f"node {node_b} (" in message and "bundle 1" in message
        assert "another process already listens" in message
        assert node_a not in message
        # Node A's sender started, then was stopped: its socket is gone; the squatter serves.
        assert not os.path.exists(f"{sock_dir}/{node_a}.sock")
        with Publisher(squatter.address) as publisher:
            assert publisher.status() is not None


def test_tcp_senders_take_the_token_given_and_close_as_their_handles_go(
    cluster: Cluster, pg: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = "ray-passes-this-token-" + os.urandom(8).hex()
    senders = SenderActors.start(pg, listen="{node_ip}:0", token=token)
    addresses = list(senders.addresses().values())
    assert all(re.fullmatch(r"[\d.]+:\d+", a) for a in addresses), addresses
    # Receivers on other nodes meet a TCP sender's broadcast group at its node's IP.
    assert [s.broadcast_host for s in senders.senders] == [s.node_ip for s in senders.senders]
    for address in addresses:
        with Publisher(address) as publisher, pytest.raises(ConfigError, match="token"):
            publisher.status()  # the session's token, not the senders'
    monkeypatch.setenv("WEIGHTSYNC_TOKEN", token)
    for address in addresses:
        with Publisher(address) as publisher:
            publisher.publish(TinyNet().state_dict(), version=1)  # allocates staging
    staged = shm_segments("{node_ip}:0".format(node_ip=addresses[0].rpartition(":")[0]))
    assert len({s.split("-")[2] for s in staged}) == NODES, f"not both senders staged: {staged}"

    # Never shut down: as the handles go, the actors exit gracefully and close their senders
    # (a killed sender would leave its staging shm behind).
    del senders
    gc.collect()
    wait_until(lambda: not any(map(os.path.exists, staged)), 60, "senders outlived their handles")
    logs = cluster.head_node.get_session_dir_path()
    found = subprocess.run(["grep", "-rl", token, logs], capture_output=True, text=True)
    assert found.stdout == "", f"the token appears in Ray's files: {found.stdout}"


@pytest.mark.parametrize(
    ("listen", "error"),
    [
        ("{node}:0", "may name only {node_id} and {node_ip}"),
        ("unix:run/{node_id}.sock", "a unix socket path must be absolute"),
    ],
)
def test_a_bad_listen_template_is_refused_before_any_actor(listen: str, error: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"listen={listen!r}")) as refused:
        SenderActors.start(None, listen=listen)  # no cluster, no placement group needed
    assert error in str(refused.value)
