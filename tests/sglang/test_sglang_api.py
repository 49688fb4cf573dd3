"""What the receiver relies on in the installed SGLang, checked without a server (none runs on
CPU): the HTTP routes and request fields the client sends, the custom-loader call, and the LoRA
manager's tensor-loading API."""

from __future__ import annotations

import inspect
import json
import re
import typing
from pathlib import Path

import pytest
import torch

from tests.support.sglang import FakeSglang, install_cpu_shims
from weightsync.errors import ConfigError, ReceiverFailedError
from weightsync.manifest import LoraAdapterSpec

pytestmark = pytest.mark.sglang

install_cpu_shims()


def test_client_routes_and_fields_exist_in_installed_sglang():
    import sglang
    from sglang.srt.managers import io_struct

    from weightsync.drivers.sglang import PauseMode, SglangHttpClient

    # Read, not imported: the server module needs uvicorn/fastapi, which the test venv omits.
    source = (Path(sglang.__file__).parent / "srt/entrypoints/http_server.py").read_text()
    routes = set(re.findall(r'@app\.(?:post|api_route)\("(/[a-z_]+)"', source))
    with FakeSglang() as fake:
        SglangHttpClient(fake.url, pause=PauseMode.WAIT, release_kv_cache=True).update(1)
    inputs = {
        "/pause_generation": io_struct.PauseGenerationReqInput,
        "/release_memory_occupation": io_struct.ReleaseMemoryOccupationReqInput,
        "/begin_weight_update": io_struct.BeginWeightUpdateReqInput,
        "/update_weights_from_tensor": io_struct.UpdateWeightsFromTensorReqInput,
        "/end_weight_update": io_struct.EndWeightUpdateReqInput,
        "/resume_memory_occupation": io_struct.ResumeMemoryOccupationReqInput,
        "/update_weight_version": io_struct.UpdateWeightVersionReqInput,
        "/continue_generation": io_struct.ContinueGenerationReqInput,
    }
    for route, body in fake.requests:
        assert route in routes, route
        if route in inputs:
            assert set(body) <= set(inputs[route].__struct_fields__), route
    modes = typing.get_type_hints(io_struct.PauseGenerationReqInput)["mode"]
    assert {m.value for m in PauseMode} == set(typing.get_args(modes))


def test_custom_loader_is_called_with_model_and_tensors():
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.utils import dynamic_import

    from weightsync.receiver.sglang.hook import HOOK_PATH, sync_weights

    assert dynamic_import(HOOK_PATH) is sync_weights
    assert "custom_loader(self.get_model(), named_tensors)" in inspect.getsource(
        WeightUpdater.update_weights_from_tensor
    )


def test_hook_refuses_tensors_over_http_and_needs_an_address(monkeypatch):
    from weightsync.receiver.sglang import hook

    with pytest.raises(ConfigError, match="'w'"):
        hook.sync_weights(torch.nn.Linear(2, 2), [("w", torch.zeros(1))])
    monkeypatch.delenv(hook.ADDRESS_ENV, raising=False)
    with pytest.raises(ConfigError, match=hook.ADDRESS_ENV):
        hook.sync_weights(torch.nn.Linear(2, 2), [])


def test_lora_manager_api_signatures():
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.lora.lora_registry import LoRARef

    params = inspect.signature(LoRAManager.load_lora_adapter_from_tensors).parameters
    assert list(params)[:4] == ["self", "lora_ref", "tensors", "config_dict"]
    assert list(inspect.signature(LoRAManager.unload_lora_adapter).parameters) == [
        "self",
        "lora_ref",
    ]
    assert {"lora_id", "lora_name", "lora_path"} <= set(LoRARef.__struct_fields__)


class FakeLoraManager:
    """The slice of SGLang's LoRAManager the loader uses (the real one needs a GPU server)."""

    def __init__(self, fail_load: bool = False) -> None:
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        self.result = LoRAUpdateOutput
        self.lora_refs: dict = {}
        self.calls: list[tuple[str, str]] = []
        self.fail_load = fail_load
        self.max_lora_rank = 16

    def unload_lora_adapter(self, ref):
        self.calls.append(("unload", ref.lora_id))
        self.lora_refs.pop(ref.lora_id)
        return self.result(success=True)

    def load_lora_adapter_from_tensors(self, ref, tensors, config_dict):
        self.calls.append(("load", ref.lora_id))
        if self.fail_load:
            return self.result(success=False, error_message="rank too large")
        self.lora_refs[ref.lora_id] = ref
        return self.result(success=True)


def test_lora_loader_replaces_the_adapter_under_the_same_ref():
    from weightsync.receiver.sglang.lora_loader import SglangLoraLoader

    manager = FakeLoraManager()
    loader = SglangLoraLoader(manager)
    spec = LoraAdapterSpec("policy", json.dumps({"r": 8}), ())
    loader.load(spec, {}, 1)
    loader.load(spec, {}, 2)
    (first_id,) = manager.lora_refs
    assert manager.calls == [("load", first_id), ("unload", first_id), ("load", first_id)]


def test_lora_loader_reports_failures_and_rank_limits():
    from weightsync.errors import ManifestMismatchError
    from weightsync.receiver.sglang.lora_loader import SglangLoraLoader

    loader = SglangLoraLoader(FakeLoraManager(fail_load=True))
    with pytest.raises(ManifestMismatchError, match="--max-lora-rank 16"):
        loader.validate(LoraAdapterSpec("policy", json.dumps({"r": 32}), ()))
    with pytest.raises(ReceiverFailedError, match="rank too large"):
        loader.load(LoraAdapterSpec("policy", "{}", ()), {}, 1)
