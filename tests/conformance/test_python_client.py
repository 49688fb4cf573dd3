"""Conformance: a Python client built from the .proto alone (``client.py``, no weightsync
import) drives the live sender as a publisher and as a receiver on the shm path.

What each test pins down is in docs/protocol.md; the sender is the real CLI
(``weightsync-sender``) in a subprocess, shared by the session (versions increase across tests).
"""

from __future__ import annotations

import json
import threading

import pytest

from tests.support.conformance import (
    CHECKSUM_EXAMPLES,
    REPO,
    TENSORS,
    applied_alone,
    assert_same_tensors,
    connected_receivers,
    expected_hex,
    implementation_checksum,
    num,
    raw_bytes,
    receiver_status,
    torch_tensors,
    version_status,
)
from tests.support.models import holder_module
from tests.support.waiting import wait_until

DOC = REPO / "docs" / "protocol.md"


def test_checksum_examples_match_the_spec_and_the_implementation(clients):
    doc = DOC.read_text()
    for what, data in CHECKSUM_EXAMPLES.items():
        want = implementation_checksum(data)
        got = clients.run("checksum", stdin=data.hex())[0]["value"]
        assert got == want, f"{what}: client {got}, weightsync {want}"
        assert want in doc, f"docs/protocol.md does not give {want} for {what}"


def _wait_alone(clients, *receiver_ids: str) -> None:
    """Wait until exactly these receivers are connected (earlier tests' ones have left)."""
    wait_until(
        lambda: connected_receivers(clients) == set(receiver_ids),
        20,
        f"connected receivers to be {sorted(receiver_ids)}",
    )


def test_receiver_applies_a_version_from_weightsync_publisher(clients, sender):
    from weightsync.sender import Publisher

    version = sender.next_version()
    rid = f"conformance-py-{version}"
    rx = clients.start("receive", "--receiver-id", rid)
    assert rx.next_event("registered")["receiver_id"] == rid
    _wait_alone(clients, rid)

    tensors = torch_tensors(seed=version)
    with Publisher(sender.address, publisher_id="conformance-weightsync") as publisher:
        result = publisher.publish(tensors, version, wait=True, timeout_s=30)

    got = rx.next_event("applied")
    assert got["version"] == version
    assert_same_tensors(got["tensors"], expected_hex(tensors))
    assert got["buckets"] == result.status.num_buckets > 2  # several buckets, one tensor chunked

    status = clients.run("status")[0]["status"]  # as the client sees it
    me = applied_alone(status, rid, version)
    assert me["state"] == "idle" and me["connected"] and me["data_path"] == "map"

    rx.close()
    assert rx.next_event("closed")["receiver_id"] == rid
    wait_until(
        lambda: receiver_status(clients.status(), rid)["state"] == "disconnected",
        10,
        "the receiver to show as disconnected",
    )
    assert num(receiver_status(clients.status(), rid), "applied_version") == version


@pytest.mark.parametrize("mode", ["offer", "offer_path_on_grpc", "pack"])
def test_publisher_on_shm(clients, sender, mode):
    """``offer``: the client's tensors sit in a shm buffer of its own, offered as pieces; the
    client is on a lane and passes the buffer's open descriptor with its begin (§1.1, §6.1),
    so the sender maps it and packs every bucket itself (``sender_packed``, no ``pack``).
    ``offer_path_on_grpc``: the same offer by path alone on gRPC: the sender never opens a path
    a client names (issue 35), so it asks the client to ``pack`` every bucket (§3.1).
    ``pack``: the client packs each bucket into the sender's staging buffer when asked.
    Received by weightsync's own receiver and by the client's, bit-exact."""
    from weightsync.receiver import TorchReceiver

    version = sender.next_version()
    rid, torch_rid = f"conformance-py-{version}", f"conformance-torch-{version}"
    rx = clients.start("receive", "--receiver-id", rid)
    rx.next_event("registered")
    zeros = {name: t.zero_() for name, t in torch_tensors(0).items()}
    model = holder_module(zeros)
    with TorchReceiver(model, sender.address, receiver_id=torch_rid) as real:
        _wait_alone(clients, rid, torch_rid)
        synced: dict = {}

        def sync() -> None:
            try:
                synced["version"] = real.sync(timeout=30)
            except Exception as e:  # reported below
                synced["error"] = e

        thread = threading.Thread(target=sync)
        thread.start()
        published = clients.run(
            "publish",
            "--version",
            str(version),
            "--tensors",
            json.dumps(TENSORS),
            "--seed",
            str(version),
            "--mode",
            "pack" if mode == "pack" else "offer",
            *(["--lane"] if mode == "offer" else []),
        )[0]
        thread.join(30)
        assert synced.get("version") == version, synced
        got = rx.next_event("applied")

        want = published["tensors"]
        assert_same_tensors(got["tensors"], want)
        state = model.state_dict()
        for name, spec in want.items():
            assert raw_bytes(state[name]) == bytes.fromhex(spec["hex"]), name

        welcome = published["welcome"]
        assert num(welcome, "bucket_size_bytes") == 4096
        assert num(welcome, "last_version") == version - 1
        assert num(published["staged"], "receivers") == 2
        done = published["done"]
        assert done["state"] == "complete", json.dumps(done.get("receivers"))
        assert published["lane"] == (mode == "offer")
        assert done.get("sender_packed", False) == (mode == "offer")
        assert num(done, "staged_bytes") == num(done, "total_bytes") > 0
        packs = [] if mode == "offer" else list(range(num(done, "num_buckets")))
        assert sorted(published["packs"]) == packs
        assert {o["receiver_id"]: o["state"] for o in done["receivers"]} == {
            rid: "applied",
            torch_rid: "applied",
        }

        waited = clients.run("wait-applied", str(version))[0]["version"]
        assert waited["state"] == "complete" and num(waited, "version") == version
        status = clients.status()
        for r in (rid, torch_rid):
            assert num(receiver_status(status, r), "applied_version") == version
            assert receiver_status(status, r)["state"] == "idle"
    rx.close()


@pytest.mark.parametrize("mode", ["offer", "pack"])
def test_later_versions_go_by_key_both_ways(clients, sender, mode):
    """§2.1: on one stream the client publishes its begin once with its contents, then by its
    key alone (``offer``: the sender packs from the buffer the first begin passed; ``pack``: it
    asks for every bucket again), and its receiver, which keeps manifests, gets the second
    manifest as its key alone; every version lands bit-exact."""
    first, second = sender.next_version(), sender.next_version()
    rid = f"conformance-keys-{first}"
    rx = clients.start("receive", "--receiver-id", rid, "--versions", "2")
    rx.next_event("registered")
    _wait_alone(clients, rid)
    published = clients.run(
        "publish",
        "--version",
        str(first),
        "--versions",
        "2",
        "--tensors",
        json.dumps(TENSORS),
        "--seed",
        str(first),
        "--mode",
        mode,
        *(["--lane"] if mode == "offer" else []),
    )
    assert [(p["version"], p["begin_by_key"]) for p in published] == [
        (first, False),
        (second, True),
    ]
    assert published[0]["welcome"]["begin_keys"]
    for p in published:
        done = p["done"]
        assert done["state"] == "complete", json.dumps(done.get("receivers"))
        assert done.get("sender_packed", False) == (mode == "offer")
        got = rx.next_event("applied")
        assert (got["version"], got["manifest_by_key"]) == (p["version"], p is published[1])
        assert_same_tensors(got["tensors"], p["tensors"])
    assert published[0]["tensors"] != published[1]["tensors"]  # new values, same memory
    rx.close()


def test_rejected_manifest_fails_only_that_receiver(clients, sender):
    from weightsync.sender import Publisher

    version = sender.next_version()
    rid = f"conformance-reject-{version}"
    rx = clients.start("receive", "--receiver-id", rid, "--reject")
    rx.next_event("registered")
    _wait_alone(clients, rid)
    with Publisher(sender.address, publisher_id="conformance-weightsync") as publisher:
        publisher.publish(torch_tensors(seed=version), version, wait=False, timeout_s=30)
    rejected = rx.next_event("rejected")
    assert rejected["version"] == version

    waited = clients.run("wait-applied", str(version))[0]["version"]
    assert waited["state"] == "failed"
    (outcome,) = waited["receivers"]
    assert outcome["receiver_id"] == rid and outcome["state"] == "failed"
    assert outcome["error"] == rejected["error"]  # the verdict's ErrorDetail, as sent
    me = receiver_status(clients.status(), rid)
    # Rejected before any write: it keeps its previous weights (none), it is not dirty.
    assert me["state"] == "idle" and num(me, "applied_version") == 0
    assert me["last_error"] == rejected["error"]["message"]
    rx.close()


def test_error_statuses(clients, sender):
    version = sender.next_version()
    _wait_alone(clients)
    cases = clients.run("errors", "--version", str(version))[0]["cases"]

    def check(case: str, code: str, prefix: str = "") -> None:
        got = cases[case]
        assert got["code"] == code, f"{case}: {got}"
        assert got["details"].startswith(prefix), f"{case}: {got}"

    first = "ProtocolError: expected a hello message first, got a message of kind"
    check("receive_without_hello", "FAILED_PRECONDITION", f"{first} 'ack'")
    check("publish_without_hello", "FAILED_PRECONDITION", f"{first} 'begin'")
    check("replaced_receiver_id", "ALREADY_EXISTS", "ReplacedError: receiver id 'conformance-dup-")
    # No receiver: the publisher packs the one bucket when asked, and the version is staged.
    assert cases["publish_ok"] == {
        "code": "OK",
        "details": "",
        "replies": ["welcome", "pack", "staged"],
    }
    check("publish_same_version_again", "FAILED_PRECONDITION", "VersionError: ")
    assert cases["publish_same_version_again"]["replies"] == ["welcome"]
    check("publish_version_zero", "INVALID_ARGUMENT", "PlanError: ")
    check("publish_duplicate_names", "INVALID_ARGUMENT", "PlanError: ")
    check("publish_unknown_dtype", "INVALID_ARGUMENT", "ConfigError: ")
    check(
        "publish_part_past_count",
        "INVALID_ARGUMENT",
        "PlanError: VersionPart index 2 of 2 parts: a split version has 2 or more parts, "
        "indexed from 0",
    )
    check(
        "publish_by_unknown_key",
        "FAILED_PRECONDITION",
        f"ProtocolError: BeginVersion of version {version + 1} came by begin_key 0102 alone",
    )
    status = clients.status()
    assert version_status(status, version)["state"] == "complete"
    # The failed begins left nothing behind: the next version is still version + 1.
    assert max(num(v, "version") for v in status["versions"]) == version
