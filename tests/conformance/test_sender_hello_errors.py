"""Conformance: a hello the sender cannot serve ends the stream INVALID_ARGUMENT naming the
field (docs/protocol.md §10), and leaves no publisher behind; the session's sender is then
still stopped by SIGTERM at teardown (an empty device used to hang the stream and the exit)."""

from __future__ import annotations

from tests.support.waiting import wait_until


def test_an_empty_publisher_device_is_invalid_argument(clients, sender):
    version = sender.next_version()
    (result,) = clients.run("errors", "--version", str(version), "--empty-device")
    assert result["cases"]["publish_empty_device"] == {
        "code": "INVALID_ARGUMENT",
        "details": "ConfigError: PublisherHello.device is empty; send 'cpu' or 'cuda:N' "
        "(where this rank's tensors live)",
        "replies": [],
    }
    wait_until(
        lambda: (
            not [
                p
                for p in clients.status().get("publishers", [])
                if p["publisher_id"] == "conformance-errors"
            ]
        ),
        10,
        "the refused publisher to be gone from Status",
    )
    # Nothing was begun: the version is still free.
    assert all(int(v["version"]) < version for v in clients.status().get("versions", []))
