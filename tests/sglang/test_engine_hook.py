"""The SGLang hook in a real offline ``sglang.Engine`` on CPU (tokenizer manager here; scheduler
and detokenizer in child processes), fed by a real sender over gRPC and shm.

Each version is driven as ``weightsync.drivers.sglang.SglangHttpClient`` drives a server, through
the Engine's methods of the same names (the client speaks HTTP only; this engine has no HTTP
server): ``begin_weight_update``, ``update_weights_from_tensor`` with an empty payload and the
hook's ``load_format``, ``end_weight_update``, ``flush_cache``; the trainer publishes from a
thread once the worker has registered. One engine for the module (minutes to start here), LoRA
on, with the adapter's name registered at launch (``lora_paths``).
"""

from __future__ import annotations

import json
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import random_weights, unix_sender, wait_until
from tests.support.models import checkpoint_tensors
from tests.support.sglang import expected_live, install_cpu_shims
from tests.support.sglang_engine import greedy, sglang_engine, tiny_checkpoint
from weightsync.errors import ConfigError, ReceiverFailedError
from weightsync.manifest import LoraAdapterSpec
from weightsync.receiver.sglang.hook import ADDRESS_ENV, HOOK_PATH, model_runner_of
from weightsync.sender import Publisher, PublishResult

pytestmark = pytest.mark.sglang

install_cpu_shims()

ADAPTER = "policy"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 8
PROMPTS = ((1, 2, 3, 4), (17, 99, 250, 3, 8), (400, 7))
NEW_TOKENS = 8
TIMEOUT_S = 600.0
"""For waits on the engine and the sender (generous: the CI box is loaded)."""


def random_adapter(
    base: dict[str, torch.Tensor], seed: int
) -> tuple[dict[str, torch.Tensor], dict]:
    """A rank-``RANK`` LoRA adapter over every ``TARGETS`` matrix of ``base``: PEFT tensor names
    and a PEFT ``adapter_config`` (random, non-zero A and B, so it changes generation)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, weight in base.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in TARGETS:
            stem = f"base_model.model.{module}"
            tensors[f"{stem}.lora_A.weight"] = (
                torch.randn(RANK, weight.shape[1], generator=gen) * 0.2
            )
            tensors[f"{stem}.lora_B.weight"] = (
                torch.randn(weight.shape[0], RANK, generator=gen) * 0.2
            )
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 16, "target_modules": TARGETS}
    return tensors, config


def save_adapter(directory: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """A PEFT adapter folder (what SGLang's ``load_lora_adapter`` and ``lora_paths`` read)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def succeeded(answer: tuple[bool, str]) -> None:
    """An Engine weight-update call's ``(success, message)``."""
    success, message = answer
    assert success, message


class Served:
    """The engine, its sender's publisher, and the versions applied so far."""

    def __init__(self, engine: Any, publisher: Publisher, root: Path, template: dict) -> None:
        self.engine = engine
        self.publisher = publisher
        self.root = root
        self.template = template
        self.version = 0

    def update(
        self, tensors: dict[str, torch.Tensor], lora: LoraAdapterSpec | None = None
    ) -> PublishResult | Exception:
        """Publish ``tensors`` as the next version and apply it through the hook; returns
        what the trainer's ``publish(wait=True)`` returned or raised (SGLang answers every
        step with success either way, or this fails)."""
        self.version += 1
        version, results, updated = self.version, [], threading.Event()

        def publish() -> None:
            try:
                # The worker registers on its first update call, and a version goes to the
                # receivers registered when it is published.
                wait_until(
                    lambda: updated.is_set() or len(self.publisher.status().receivers) == 1,
                    TIMEOUT_S,
                    "the SGLang worker never registered with the sender",
                    interval=0.1,
                )
                if not updated.is_set():
                    results.append(
                        self.publisher.publish(
                            tensors, version, lora=lora, wait=True, timeout_s=TIMEOUT_S
                        )
                    )
            except Exception as e:  # surfaced in the test's thread
                results.append(e)

        trainer = threading.Thread(target=publish)
        trainer.start()
        try:
            succeeded(self.engine.begin_weight_update("target"))
            try:
                answer = self.engine.update_weights_from_tensor(
                    [], load_format=HOOK_PATH, flush_cache=False
                )
            finally:
                ended = self.engine.end_weight_update()  # on failure too, as the client does
            succeeded(answer)
            succeeded(ended)
            # The prefix cache holds KV computed with the old weights (and the old adapter:
            # SGLang keys it by the adapter's id, which stays the same).
            self.engine.flush_cache()
        finally:
            updated.set()
            trainer.join(TIMEOUT_S)
        (result,) = results
        return result

    def apply(self, tensors: dict[str, torch.Tensor], lora: LoraAdapterSpec | None = None) -> None:
        """``update``, which the worker must apply."""
        result = self.update(tensors, lora)
        assert not isinstance(result, Exception), result
        assert [r.state for r in result.status.receivers] == ["applied"]

    def live_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the worker's live model, read back bit-exact (SGLang's
        ``save_sharded_model`` writes the model's state dict), by name without LoRA's
        ``base_layer`` wrapper."""
        directory = tempfile.mkdtemp(prefix=f"live{self.version}-", dir=self.root)
        self.engine.save_sharded_model(path=directory, pattern=None, max_size=None)
        return {
            name.replace(".base_layer.", "."): tensor
            for name, tensor in checkpoint_tensors(directory).items()
        }

    def greedy(self, lora_path: str | None = None) -> list[list[int]]:
        return greedy(self.engine, PROMPTS, NEW_TOKENS, lora_path=lora_path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_hook")
    model = tiny_checkpoint(root / "model")
    template = checkpoint_tensors(model)
    initial = save_adapter(root / "initial", *random_adapter(template, seed=1))
    with (
        unix_sender(bucket_size_bytes=64 * 1024, ack_timeout_s=TIMEOUT_S) as sender,
        sglang_engine(
            model,
            env={ADDRESS_ENV: sender.address},
            custom_weight_loader=[HOOK_PATH],
            enable_lora=True,
            lora_backend="torch_native",
            max_lora_rank=RANK,
            lora_target_modules=TARGETS,
            lora_paths=[f"{ADAPTER}={initial}"],
        ) as engine,
    ):
        publisher = Publisher(sender.address)
        try:
            yield Served(engine, publisher, root, template)
        finally:
            publisher.close()


def test_versions_through_the_hook_write_every_parameter_bit_exact(served):
    before = served.greedy()
    for seed in (101, 102):
        weights = random_weights(served.template, seed=seed)
        served.apply(weights)
        live = served.live_parameters()
        expected = expected_live(weights)  # packed by hand, independent of SGLang's loaders
        assert live.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(live[name], tensor), name
        after = served.greedy()
        assert after != before  # the engine serves the new weights
        before = after


def test_a_lora_adapter_is_replaced_in_place_and_served_by_name(served):
    previous = None
    for seed in (201, 202):
        weights = random_weights(served.template, seed=seed)
        adapter, config = random_adapter(served.template, seed=seed + 1)
        spec = LoraAdapterSpec(ADAPTER, json.dumps(config), tuple(adapter))
        served.apply({**weights, **adapter}, lora=spec)
        with_adapter = served.greedy(lora_path=ADAPTER)
        # The reference: the same adapter loaded by SGLang itself from a PEFT folder.
        reference = f"reference{seed}"
        path = save_adapter(served.root / reference, adapter, config)
        loaded = served.engine.load_lora_adapter(reference, str(path))
        assert loaded.success, loaded.error_message
        assert loaded.loaded_adapters[ADAPTER] == str(served.root / "initial")  # same ref
        assert with_adapter == served.greedy(lora_path=reference)
        assert served.engine.unload_lora_adapter(reference).success
        assert with_adapter != served.greedy()  # the adapter changes generation
        assert with_adapter != previous  # the new adapter replaced the old one
        previous = with_adapter


def test_an_adapter_the_server_cannot_hold_is_rejected_before_any_write(served):
    weights = random_weights(served.template, seed=301)
    adapter, config = random_adapter(served.template, seed=302)
    for change, message in (
        ({"r": 16}, "has rank 16 but the server was launched with --max-lora-rank 8"),
        ({"target_modules": [*TARGETS, "lm_head"]}, r"targets \['lm_head'\], which the server"),
    ):
        live, tokens = served.live_parameters(), served.greedy(lora_path=ADAPTER)
        spec = LoraAdapterSpec(ADAPTER, json.dumps({**config, **change}), tuple(adapter))
        # SGLang 0.5.23 dies on a custom loader's exception, so the hook logs a version that
        # wrote nothing and SGLang reports success; the trainer learns it from the sender.
        failure = served.update({**weights, **adapter}, lora=spec)
        assert isinstance(failure, ReceiverFailedError)
        assert re.search(f"ManifestMismatchError: .*{message}", str(failure)), failure
        after = served.live_parameters()
        assert after.keys() == live.keys()
        assert all(torch.equal(after[name], t) for name, t in live.items())
        assert served.greedy(lora_path=ADAPTER) == tokens


def test_no_runner_holding_the_model_is_a_config_error():
    with pytest.raises(ConfigError, match=r"found 0 .*ModelRunner objects whose \.model"):
        model_runner_of(torch.nn.Linear(2, 2))
