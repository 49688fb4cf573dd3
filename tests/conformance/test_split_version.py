"""Conformance: a version split over two senders (``Manifest.part``, docs/protocol.md §4.1).

Two ``weightsync-sender`` processes stand for two trainer hosts ("trainer-a", "trainer-b");
the Python client publishes one part to each (part 0 packed when asked, part 1 offered), with
a ``plan_digest`` of its own making. The Python and the Node receivers register with both
senders, join the parts, answer both alike and apply the version bit-exact; weightsync's own
receiver, registered with both too, applies the conformance publishers' parts as well. Parts
that disagree on the plan are refused by every receiver on both senders before any write."""

from __future__ import annotations

import json
import threading

import pytest

from tests.conformance.support import SPLIT_PLAN, SPLIT_SENDERS, NodeReceivers
from tests.support.conformance import (
    Clients,
    assert_same_tensors,
    connected_receivers,
    num,
    raw_bytes,
    receiver_status,
    version_status,
)
from tests.support.waiting import wait_until


@pytest.fixture
def split(stubs, node_modules, split_senders):
    a, b = split_senders
    rig = {
        "senders": (a, b),
        "clients": (Clients(stubs, a.address), Clients(stubs, b.address)),
        "node": NodeReceivers(node_modules, a.address),
    }
    try:
        yield rig
    finally:
        for c in rig["clients"]:
            c.kill_all()
        rig["node"].kill_all()


def _version(rig) -> int:
    a, b = rig["senders"]
    version = a.next_version()
    assert b.next_version() == version  # one version number on both senders
    return version


def _receivers(rig, version: int, *extra: str) -> tuple:
    """The Python and the Node receiver, each registered with both senders."""
    a, b = rig["senders"]
    py_id, node_id = f"conformance-split-py-{version}", f"conformance-split-node-{version}"
    py = rig["clients"][0].start("receive", "--receiver-id", py_id, "--address", b.address)
    nd = rig["node"].start(node_id, addresses=(a.address, b.address))
    assert py.next_event("registered")["receiver_id"] == py_id
    assert nd.next_event("registered")["receiver_id"] == node_id
    return py, nd, py_id, node_id


def _wait_connected(rig, ids: set[str]) -> None:
    for c in rig["clients"]:
        wait_until(lambda c=c: connected_receivers(c) == ids, 20, f"{sorted(ids)} on both senders")


def _publish_parts(rig, version: int, plans: list, modes=("pack", "offer")) -> list[dict]:
    """One conformance publisher per sender, each publishing its part of ``plans[i]``."""
    pubs = [
        rig["clients"][i].start(
            "publish",
            "--version",
            str(version),
            "--plan",
            json.dumps(plans[i]),
            "--part",
            str(i),
            "--sender-id",
            SPLIT_SENDERS[i],
            "--seed",
            str(version),
            "--mode",
            modes[i],
        )
        for i in range(2)
    ]
    return [p.next_event("published", timeout_s=60) for p in pubs]


def test_a_version_split_over_two_senders_is_joined_and_applied_bit_exact(split):
    import torch

    from tests.support.models import holder_module
    from weightsync.receiver import TorchReceiver

    a, b = split["senders"]
    version = _version(split)
    py, nd, py_id, node_id = _receivers(split, version)
    torch_id = f"conformance-split-torch-{version}"
    zeros = {
        s["name"]: torch.zeros(s["shape"], dtype=getattr(torch, s["dtype"]))
        for part in SPLIT_PLAN
        for s in part
    }
    model = holder_module(zeros)
    with TorchReceiver(model, [a.address, b.address], receiver_id=torch_id) as real:
        _wait_connected(split, {py_id, node_id, torch_id})
        synced: dict = {}

        def sync() -> None:
            try:
                synced["version"] = real.sync(timeout=60)
            except Exception as e:  # reported below
                synced["error"] = e

        thread = threading.Thread(target=sync)
        thread.start()
        published = _publish_parts(split, version, [SPLIT_PLAN, SPLIT_PLAN])
        thread.join(60)
        assert synced.get("version") == version, synced

    want = published[0]["tensors"] | published[1]["tensors"]
    assert len(want) == sum(len(p) for p in SPLIT_PLAN)
    for i, pub in enumerate(published):
        done = pub["done"]
        assert done["state"] == "complete", json.dumps(done.get("receivers"))
        # Part 0 packs when asked; part 1 offers its memory (the sender packs it, or asks for
        # `pack` where it cannot map it, §3.1): either way every bucket is packed once.
        packed_by_sender = done.get("sender_packed", False)
        assert not (i == 0 and packed_by_sender)
        want_packs = [] if packed_by_sender else list(range(num(done, "num_buckets")))
        assert sorted(pub["packs"]) == want_packs
        assert {o["receiver_id"]: o["state"] for o in done["receivers"]} == {
            py_id: "applied",
            node_id: "applied",
            torch_id: "applied",
        }
        assert set(pub["tensors"]) == {s["name"] for s in SPLIT_PLAN[i]}
    for rx in (py, nd):
        got = rx.next_event("applied")
        assert got["version"] == version and got["error"] is None
        assert_same_tensors(got["tensors"], want)
        # Bucket checksums are per sender: part 0's several buckets and part 1's.
        assert {key.split("/")[0] for key in got["checksums"]} == {"0", "1"}
    state = model.state_dict()
    for name, spec in want.items():
        assert raw_bytes(state[name]) == bytes.fromhex(spec["hex"]), name
    for c in split["clients"]:
        status = c.status()
        assert version_status(status, version)["state"] == "complete"
        for rid in (py_id, node_id):
            assert num(receiver_status(status, rid), "applied_version") == version
    py.close()
    nd.close()


def test_parts_of_different_plans_are_refused_on_every_sender(split):
    """Part 1 comes from another plan (one tensor more): its ``plan_digest`` and
    ``num_tensors`` differ from part 0's. Each receiver answers both senders with the same
    rejecting verdict (``PlanError``), before any write, and keeps its weights."""
    version = _version(split)
    py, nd, py_id, node_id = _receivers(split, version)
    _wait_connected(split, {py_id, node_id})
    other = [SPLIT_PLAN[0], [*SPLIT_PLAN[1], {"name": "extra", "dtype": "int8", "shape": [3]}]]
    published = _publish_parts(split, version, [SPLIT_PLAN, other])

    for rx in (py, nd):
        rejected = rx.next_event("rejected")
        assert rejected["version"] == version
        assert rejected["error"]["code"] == "PlanError"
        assert "plan" in rejected["error"]["message"]
    for pub in published:
        done = pub["done"]
        assert done["state"] == "failed"
        outcomes = {o["receiver_id"]: (o["state"], o["error"]["code"]) for o in done["receivers"]}
        assert outcomes == {py_id: ("failed", "PlanError"), node_id: ("failed", "PlanError")}
    for c in split["clients"]:
        for rid in (py_id, node_id):
            me = receiver_status(c.status(), rid)
            assert me["state"] == "idle" and num(me, "applied_version") == 0, me
    py.close()
    nd.close()
