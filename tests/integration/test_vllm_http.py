"""End to end over HTTP: a real ``vllm serve`` process (multiprocess engine, the backend
loaded from the ``vllm.general_plugins`` entry point; the TP=1 server this module shares)
fed by a real sender."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

from tests.support import random_weights  # noqa: E402
from tests.support.vllm import SERVER_TP1, hf_reference, server_greedy  # noqa: E402
from weightsync.drivers.vllm import VllmServerClient, publish_to_vllm  # noqa: E402
from weightsync.errors import ReceiverFailedError  # noqa: E402
from weightsync.sender import Publisher  # noqa: E402

pytestmark = [pytest.mark.vllm, SERVER_TP1.mark]

KIND = SERVER_TP1.kind


@pytest.fixture(scope="module")
def server(request, vllm_servers, tmp_path_factory):
    served = vllm_servers.get(SERVER_TP1, request.node)
    return tmp_path_factory.mktemp("http"), served.base_url, served.model, served.template


def test_three_versions_over_http_then_bad_version_keeps_serving(server, sender_address):
    root, base_url, model, template = server
    client = VllmServerClient(base_url)
    client.init(sender_address, receiver_id="http-test")
    with Publisher(sender_address) as publisher:
        for version in (1, 2, 3):
            weights = random_weights(template, seed=500 + version)
            publish_to_vllm(publisher, weights, version, [client], timeout_s=120)
            assert client.weight_version() == str(version)
            assert server_greedy(base_url, model) == hf_reference(
                KIND, root / f"r{version}", weights
            )
        bad = {**weights, "model.layers.0.mlp.bogus.weight": weights["model.norm.weight"]}
        with pytest.raises(ReceiverFailedError, match="bogus"):
            publish_to_vllm(publisher, bad, 4, [client], timeout_s=120)
        receivers = {r.receiver_id: r.applied_version for r in publisher.status().receivers}
    assert receivers == {"http-test-rank0": 3}
    assert client.weight_version() == "3"
    assert server_greedy(base_url, model) == hf_reference(KIND, root / "r3", weights)
