"""Conformance: a receiver that leaves in order right after ``applied`` (docs/protocol.md §4,
"Leaving": half-close, read the stream to its end, status ``OK``) stays applied in that
version, and Status shows it disconnected holding it. The Python and the Node client each
leave the moment they sent ``applied``."""

from __future__ import annotations

import pytest

from tests.support.conformance import (
    assert_same_tensors,
    connected_receivers,
    expected_hex,
    num,
    receiver_status,
    torch_tensors,
    version_status,
)
from tests.support.waiting import wait_until


@pytest.mark.parametrize("client", ["python", "node"])
def test_a_receiver_that_leaves_in_order_after_applied_stays_applied(
    client, clients, sender, request
):
    from weightsync.sender import Publisher

    version = sender.next_version()
    rid = f"conformance-leave-{client}-{version}"
    if client == "python":
        rx = clients.start("receive", "--receiver-id", rid, "--leave")
    else:
        rx = request.getfixturevalue("node_clients").start(rid, "--leave")
    assert rx.next_event("registered")["receiver_id"] == rid
    wait_until(lambda: connected_receivers(clients) == {rid}, 20, f"only {rid} connected")

    tensors = torch_tensors(seed=version)
    with Publisher(sender.address, publisher_id="conformance-weightsync") as publisher:
        result = publisher.publish(tensors, version, wait=True, timeout_s=30)

    got = rx.next_event("applied")
    assert got["version"] == version and got["error"] is None
    assert_same_tensors(got["tensors"], expected_hex(tensors))
    # It left at once, in order: the sender ended its stream OK.
    closed = rx.next_event("closed")
    assert closed["receiver_id"] == rid
    assert [s["code"] for s in closed["statuses"]] == ["OK"], closed
    rx.close()

    # Its leaving did not fail it: the version is complete, with it applied.
    outcomes = {o.receiver_id: (o.state, o.error.message) for o in result.status.receivers}
    assert outcomes == {rid: ("applied", "")}
    assert result.status.state == "complete"
    wait_until(
        lambda: receiver_status(clients.status(), rid)["state"] == "disconnected",
        10,
        f"{rid} to show as disconnected",
    )
    status = clients.status()
    me = receiver_status(status, rid)
    assert num(me, "applied_version") == version
    assert not me.get("connected") and not me.get("last_error"), me
    v = version_status(status, version)
    assert v["state"] == "complete"
    assert [(o["receiver_id"], o["state"]) for o in v["receivers"]] == [(rid, "applied")]
