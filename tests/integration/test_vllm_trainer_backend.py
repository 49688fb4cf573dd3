"""vLLM's own trainer-side RL flow with backend ``weightsync``: a real ``vllm serve`` process
(multiprocess engine, ``--weight-transfer-config '{"backend": "weightsync"}'``, the TP=1 server
this module shares) driven by ``WeightTransferTrainerFactory.trainer_init(...)`` /
``send_weights()`` through vLLM's HTTP client, exactly as vLLM's ``examples/rl/rlhf_http_*.py``
do, with the init info the one change. The trainer engine starts its own sender; the server's
greedy generation must equal transformers' on the trainer model after every version."""

from __future__ import annotations

import pytest
import requests
import torch

vllm = pytest.importorskip("vllm")

from vllm.distributed.weight_transfer import (  # noqa: E402
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightSource,
    WeightTransferTrainerFactory,
)

from tests.support import random_weights  # noqa: E402
from tests.support.vllm import (  # noqa: E402
    BUCKET_BYTES,
    SERVER_TP1,
    hf_config,
    hf_greedy,
    server_greedy,
)
from weightsync.errors import ReceiverFailedError  # noqa: E402

pytestmark = [pytest.mark.vllm, SERVER_TP1.mark]

KIND = SERVER_TP1.kind


@pytest.fixture(scope="module")
def server(request, vllm_servers):
    served = vllm_servers.get(SERVER_TP1, request.node)
    return served.base_url, served.model, served.template


class _WithExtra(WeightSource):
    """``source`` plus one tensor the served model lacks."""

    def __init__(self, source: WeightSource, name: str, tensor: torch.Tensor) -> None:
        self.source, self.extra = source, (name, tensor)

    def metadata(self):
        return self.source.metadata()

    def __iter__(self):
        yield from self.source
        yield self.extra


def _post(base_url: str, route: str, **params: str) -> None:
    requests.post(f"{base_url}/{route}", params=params, timeout=60).raise_for_status()


def _weight_version(base_url: str) -> str:
    response = requests.get(f"{base_url}/weight_info", timeout=10)
    response.raise_for_status()
    return response.json()["weight_version"]


def test_plugin_registers_the_trainer_engine_once(monkeypatch):
    from weightsync.drivers.vllm_trainer import WeightsyncTrainerEngine
    from weightsync.receiver import vllm_plugin

    registry = {
        k: v for k, v in WeightTransferTrainerFactory._registry.items() if k != "weightsync"
    }
    monkeypatch.setattr(WeightTransferTrainerFactory, "_registry", registry)
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM loads plugins more than once per process
    assert registry["weightsync"]() is WeightsyncTrainerEngine


def test_vllm_rl_flow_with_weightsync_backend(server, monkeypatch):
    from transformers import AutoModelForCausalLM

    from weightsync.drivers.vllm_trainer import WeightsyncTrainerEngine, WeightsyncTrainerInitInfo

    monkeypatch.delenv("WEIGHTSYNC_LISTEN", raising=False)  # the engine starts its own sender
    base_url, model, template = server
    trainer = AutoModelForCausalLM.from_config(hf_config(KIND), dtype=torch.float32).eval()
    assert {n for n, _ in trainer.named_parameters()} == set(template)

    engine = WeightTransferTrainerFactory.trainer_init(
        WeightsyncTrainerInitInfo(
            rank=0,
            receiver_id="rl-flow",
            sender_settings={"bucket_size_bytes": BUCKET_BYTES, "ack_timeout_s": 60},
            timeout_s=120,
        ),
        client=HTTPVLLMWeightSyncClient(base_url),
        source=ModuleSource(trainer),
    )
    assert isinstance(engine, WeightsyncTrainerEngine) and engine.sender is not None
    try:
        labels = {}
        # Free-text labels (vLLM's weight_version), then none: the version number as text.
        for step, label in enumerate(("step-10 run a", "step-20 run a", None), start=1):
            weights = random_weights(template, seed=900 + step)
            with torch.no_grad():
                for name, p in trainer.named_parameters():
                    p.copy_(weights[name])
            _post(base_url, "pause", mode="wait", clear_cache="true")
            try:
                if label is None:
                    version = engine.send_weights()  # vLLM's own call, unchanged
                else:
                    version = engine.send_weights(weight_version=label)
            finally:
                _post(base_url, "resume")
            assert version == step
            labels[step] = label or str(step)
            assert _weight_version(base_url) == labels[step]
            assert server_greedy(base_url, model) == hf_greedy(trainer)
        expected = hf_greedy(trainer)

        assert engine.versions == labels
        assert engine.version_of("step-10 run a") == 1
        assert engine.version_of("step-20 run a") == 2
        assert engine.version == 3 and engine.weight_version == "3"
        with pytest.raises(KeyError):
            engine.version_of("step-30")

        # A version the server cannot apply fails with the sender's reason; the server keeps
        # serving the last version under its label.
        engine.source = _WithExtra(
            ModuleSource(trainer), "model.layers.0.mlp.bogus.weight", torch.ones(128)
        )
        _post(base_url, "pause", mode="wait", clear_cache="true")
        try:
            with pytest.raises(ReceiverFailedError, match="bogus"):
                engine.send_weights(weight_version="step-30")
        finally:
            _post(base_url, "resume")
        assert engine.versions == labels and engine.weight_version == "3"
        assert _weight_version(base_url) == "3"
        assert server_greedy(base_url, model) == expected
        receivers = {r.receiver_id: r.applied_version for r in engine.publisher.status().receivers}
        assert receivers == {"rl-flow-rank0": 3}
    finally:
        engine.shutdown()
    assert engine.sender is None


class _RefusingClient:
    """vLLM's client protocol, with a server whose update_weights fails at once (as without
    ``init_weight_transfer_engine``)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init")

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        self.calls.append("update")
        raise RuntimeError("500 Server Error")

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish" if weight_version is None else f"finish {weight_version}")


def test_failed_update_fails_send_and_keeps_the_version(monkeypatch):
    from weightsync.drivers.vllm_trainer import WeightsyncTrainerInitInfo

    monkeypatch.delenv("WEIGHTSYNC_LISTEN", raising=False)
    client = _RefusingClient()
    model = torch.nn.Linear(4, 4)
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightsyncTrainerInitInfo(rank=0), client=client, source=ModuleSource(model)
    )
    try:
        with pytest.raises(ReceiverFailedError, match="500 Server Error"):
            engine.send_weights(weight_version="a")
        # The session is ended (TP > 1: the ranks that did not raise are still in it), without
        # a weight version.
        assert client.calls == ["init", "start", "update", "finish"]
        assert engine.versions == {} and engine.version == 0 and engine.weight_version is None
    finally:
        engine.shutdown()
