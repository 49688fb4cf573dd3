"""Conformance: a Node receiver (``node/client.js``: @grpc/grpc-js and @grpc/proto-loader, the
.proto loaded at run time, nothing else) applies a version from weightsync's own publisher over
shm staging buffers, bit-exact, with the checksums verified by its own implementation.

Node's packages come from ``npm ci`` of the committed lock file, cached per lock hash under
``~/.cache/weightsync/node-<hash>``; the tests fail when ``node`` or ``npm`` is missing.
"""

from __future__ import annotations

from tests.support.conformance import (
    CHECKSUM_EXAMPLES,
    applied_alone,
    assert_same_tensors,
    connected_receivers,
    expected_hex,
    implementation_checksum,
    receiver_status,
    torch_tensors,
)
from tests.support.waiting import wait_until


def test_node_checksum_matches_the_implementation(node_clients):
    for what, data in CHECKSUM_EXAMPLES.items():
        want = implementation_checksum(data)
        assert node_clients.checksum(data) == want, what


def test_node_receiver_applies_a_version_from_weightsync_publisher(node_clients, clients, sender):
    from weightsync.sender import Publisher

    version = sender.next_version()
    rid = f"conformance-node-{version}"
    rx = node_clients.start_receiver(rid)
    assert rx.next_event("registered")["receiver_id"] == rid
    wait_until(lambda: connected_receivers(clients) == {rid}, 20, f"only {rid} connected")

    tensors = torch_tensors(seed=version)
    with Publisher(sender.address, publisher_id="conformance-weightsync") as publisher:
        result = publisher.publish(tensors, version, wait=True, timeout_s=30)

    got = rx.next_event("applied")
    assert got["version"] == version and got["error"] is None
    assert_same_tensors(got["tensors"], expected_hex(tensors))
    assert got["buckets"] == result.status.num_buckets > 2

    status = clients.status()
    me = applied_alone(status, rid, version)
    assert me["state"] == "idle" and me["engine"] == "conformance-node"

    rx.close()
    assert rx.next_event("closed")["receiver_id"] == rid
    wait_until(
        lambda: not receiver_status(clients.status(), rid).get("connected"),
        10,
        "the Node receiver to show as disconnected",
    )


def test_node_receiver_keeps_the_manifest_by_key(node_clients, clients, sender):
    """§2.1: the Node receiver says ``manifest_keys``; the second version's manifest comes as
    its key alone and it applies that version from the manifest it kept, bit-exact."""
    from weightsync.sender import Publisher

    rid = "conformance-node-keys"
    rx = node_clients.start(rid, "--versions", "2")
    assert rx.next_event("registered")["receiver_id"] == rid
    wait_until(lambda: connected_receivers(clients) == {rid}, 20, f"only {rid} connected")
    with Publisher(sender.address, publisher_id="conformance-weightsync") as publisher:
        for by_key in (False, True):
            version = sender.next_version()
            tensors = torch_tensors(seed=version)
            publisher.publish(tensors, version, wait=True, timeout_s=30)
            got = rx.next_event("applied")
            assert (got["version"], got["manifest_by_key"], got["error"]) == (version, by_key, None)
            assert_same_tensors(got["tensors"], expected_hex(tensors))
    rx.close()
    assert rx.next_event("closed")["receiver_id"] == rid
