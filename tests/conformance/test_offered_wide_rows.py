"""Conformance: a publisher offering its own memory with rows wider than a bucket (a
[2, 20000] float32 tensor, 80,000-byte rows, 64 KiB buckets). docs/protocol.md §3.1: the
sender packs offered regions by whole dim-0 rows, so it falls back to asking the publisher to
``pack`` every bucket; the version applies bit-exact on the Python and the Node receiver.

This client offers by path on gRPC, which the sender no longer maps at all (issue 35: only
descriptors passed on a lane), so here ``pack`` would come for that reason too; the row-width
reason alone is held by ``tests/integration/test_offered_rows.py`` (weightsync's publisher,
which passes its descriptors). What this test holds is the client's side: an offering
publisher packs every bucket when asked, chunks that split rows included."""

from __future__ import annotations

import json

from tests.conformance.support import WIDE_BUCKET_BYTES, WIDE_TENSORS, NodeReceivers
from tests.support.conformance import (
    Clients,
    assert_same_tensors,
    connected_receivers,
    num,
    receiver_status,
)
from tests.support.waiting import wait_until


def test_offered_rows_wider_than_a_bucket_are_packed_by_the_publisher(
    stubs, node_modules, wide_sender
):
    clients = Clients(stubs, wide_sender.address)
    node = NodeReceivers(node_modules, wide_sender.address)
    try:
        version = wide_sender.next_version()
        py_id, node_id = f"conformance-wide-py-{version}", f"conformance-wide-node-{version}"
        py = clients.start("receive", "--receiver-id", py_id)
        nd = node.start(node_id)
        assert py.next_event("registered")["receiver_id"] == py_id
        assert nd.next_event("registered")["receiver_id"] == node_id
        wait_until(lambda: connected_receivers(clients) == {py_id, node_id}, 20, "both receivers")

        published = clients.run(
            "publish",
            "--version",
            str(version),
            "--tensors",
            json.dumps(WIDE_TENSORS),
            "--seed",
            str(version),
            "--mode",
            "offer",
        )[0]
        assert num(published["welcome"], "bucket_size_bytes") == WIDE_BUCKET_BYTES
        done = published["done"]
        assert done["state"] == "complete", json.dumps(done.get("receivers"))
        # 160,000 + 16 bytes: chunks of 65,536, 65,536 and 28,928 bytes (the last with the
        # small tensor): three buckets, each packed by the publisher when asked.
        assert not done.get("sender_packed", False)
        assert num(done, "num_buckets") == 3
        assert published["packs"] == [0, 1, 2]
        assert {o["receiver_id"]: o["state"] for o in done["receivers"]} == {
            py_id: "applied",
            node_id: "applied",
        }
        for rx in (py, nd):
            got = rx.next_event("applied")
            assert got["version"] == version and got["error"] is None
            assert got["buckets"] == 3
            assert_same_tensors(got["tensors"], published["tensors"])
        status = clients.status()
        for rid in (py_id, node_id):
            assert num(receiver_status(status, rid), "applied_version") == version
        py.close()
        nd.close()
    finally:
        clients.kill_all()
        node.kill_all()
