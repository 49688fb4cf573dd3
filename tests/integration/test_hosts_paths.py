"""Two senders, one per host, with engines on both hosts (issue 32's hosts case, on CPU): a
receiver maps its own host's part from its sender's staging buffers and gets only the other
host's part by broadcast; each sender broadcasts its part once, to a group of the other host's
receivers. The bench's hosts case (``weightsync.app.bench.hosts``) with two receiver processes
per host ("hosts" are ``WEIGHTSYNC_HOST_ID`` values: shm staging, gloo broadcasts), as
``weightsync bench --hosts 4`` runs it on four GPUs."""

from __future__ import annotations

from weightsync.app.bench.hosts import HOSTS, measure_hosts
from weightsync.app.bench.models import hf_specs, model_shape


def _expected_paths(receivers: list[str], sender_host: str) -> dict[str, str]:
    return {r: "map" if r.startswith(f"{sender_host}-") else "broadcast" for r in receivers}


def test_each_host_maps_its_own_part_and_broadcasts_only_to_the_other_host():
    run = measure_hosts(model_shape("tiny"), 0, 1, 0, 60.0, cpu_engines=4)
    assert run.bit_exact
    two, one = run.paths
    receivers = sorted(two[HOSTS[0]])
    assert len(receivers) == 4 and {r.split("-")[0] for r in receivers} == {"bench"}
    assert sum(r.startswith(f"{HOSTS[1]}-") for r in receivers) == 2
    for host in HOSTS:
        assert two[host] == _expected_paths(receivers, host), host
    assert one == {HOSTS[0]: _expected_paths(receivers, HOSTS[0])}
    # Each part goes out once (one group of the other host's two receivers: the model's bytes
    # once, its buckets' 256-byte alignment at most beside them), into two receivers.
    tensors = len(hf_specs(model_shape("tiny")))
    for sent in run.broadcast_bytes:
        assert run.nbytes <= sent < run.nbytes + 256 * tensors
    assert run.received_bytes == (2 * run.nbytes, 2 * run.nbytes)
