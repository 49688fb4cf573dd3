"""Issue 12, trainer side: a Megatron trainer spanning hosts publishes through one sender per
host, each HF tensor sent by one sender whose host's ranks hold it.

Real megatron-core ranks on CPU over gloo; the two "hosts" are two host ids given to the
ranks (``host_id=``, as ``WEIGHTSYNC_HOST_ID`` would on real hosts; one machine here), each
with its own real sender on its own unix socket, and a real receiver registered with both
(``TorchReceiver(model, [a, b])``) that joins the parts. Checked: what each sender announced
(its part, disjoint from the other, together every HF tensor, one digest) and what the
receiver holds after each version, bit for bit against the offline conversion.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import holder_module
from tests.support import megatron as ms

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.megatron

HOSTS = ["trainer-a", "trainer-b"]
VERSIONS = 3
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


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_host_publishes_its_part_to_its_own_sender_and_a_receiver_joins_them(
    layout, tmp_path, sock_dir
):
    from weightsync.manifest import plan_digest
    from weightsync.receiver import TorchReceiver
    from weightsync.sender.daemon import Sender
    from weightsync.sender.megatron import convert_megatron_to_hf, hf_manifest

    sizes, case_name = LAYOUTS[layout]
    case = ms.CASES[case_name]
    config = ms.hf_config(case)
    everything = hf_manifest(config, "float32")
    if case.experts:
        # transformers fuses experts in the module; hold the per-expert checkpoint names.
        model = holder_module({s.name: torch.zeros(s.shape) for s in everything})
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with (
        Sender(f"unix:{sock_dir}/a.sock", bucket_size_bytes=64 * 1024) as a,
        Sender(f"unix:{sock_dir}/b.sock", bucket_size_bytes=64 * 1024) as b,
    ):
        senders = dict(zip(HOSTS, (a, b), strict=True))
        addresses = {host: s.address for host, s in senders.items()}
        receiver = TorchReceiver(model, [a.address, b.address], receiver_id="hf")
        with ms.held_versions(receiver, model, VERSIONS) as held:
            shards = ms.launch(
                tmp_path, sizes, ms.publish_worker, case_name, addresses, False, HOSTS, VERSIONS
            )[0]
        receiver.close()
        states = {
            h: [(v.version, v.state) for v in s.coordinator.status().versions]
            for h, s in senders.items()
        }
        runs = {
            h: [s.coordinator.run_of(v) for v in range(1, VERSIONS + 1)] for h, s in senders.items()
        }
    for host in HOSTS:
        assert states[host] == [(v, "complete") for v in range(1, VERSIONS + 1)], host
        # Each sender joined only its host's one rank.
        assert all(len(run.ranks) == 1 for run in runs[host]), host
    parts = {h: [run.manifest for run in runs[h]] for h in HOSTS}
    digests = set()
    for index, host in enumerate(HOSTS):
        for manifest in parts[host]:
            part = manifest.part
            assert (part.index, part.count, part.sender_id) == (index, 2, host)
            assert part.num_tensors == len(everything)
            assert manifest.tensors == parts[host][0].tensors  # the same part every version
            digests.add(part.plan_digest)
    a_names = [s.name for s in parts[HOSTS[0]][0].tensors]
    b_names = [s.name for s in parts[HOSTS[1]][0].tensors]
    assert not set(a_names) & set(b_names)
    assert sorted(a_names + b_names) == sorted(s.name for s in everything)
    for host, names in zip(HOSTS, (a_names, b_names), strict=True):
        assert all(host in holders(n, layout) for n in names), (host, names)
    if layout == "ep2":
        # Both hosts hold the dense layers (data parallel): the bytes are balanced over them.
        sent = [parts[h][0].total_bytes for h in HOSTS]
        assert abs(sent[0] - sent[1]) <= max(s.nbytes for s in everything), sent
        assert all(any(".experts." not in n for n in ns) for ns in (a_names, b_names))
    # One digest for every part of every version: the one of the parts together.
    assert digests == {plan_digest([parts[h][0].tensors for h in HOSTS])}
    assert len(held) == VERSIONS
    for version, state in enumerate(shards):
        want = convert_megatron_to_hf(state, config)
        assert sorted(want) == sorted(s.name for s in everything)
        for name, tensor in want.items():
            assert torch.equal(held[version][name], tensor), f"version {version + 1}: {name}"


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
