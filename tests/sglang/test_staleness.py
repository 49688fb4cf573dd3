"""Per-token staleness fields from a running SGLang engine: the offline ``sglang.Engine`` on CPU
(its scheduler and detokenizer in child processes, the hooks installed there by weightsync's
SGLang plugin entry point), a tiny Llama with random weights.

One engine for the module, started with SGLang's retraction test switch (every few decode
steps the scheduler retracts one request of a running batch of two or more, freeing its KV;
the request is recomputed later). A request running alone is never retracted, so single
requests see no eviction. Versions are applied as ``weightsync.drivers.sglang`` does with
``PauseMode.KEEP``: pause in place (requests keep their KV), load the weights, set the weight
version label to ``str(version)``, continue; the weights come through SGLang's own
``update_weights_from_tensor`` instead of the weightsync sender.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.models import checkpoint_tensors
from tests.support.sglang_engine import (
    greedy,
    greedy_params,
    sglang_engine,
    tiny_checkpoint,
)
from weightsync.receiver.sglang.hook import HOOK_PATH
from weightsync.staleness import Staleness, expand_runs, policy_epoch_from_spans

RETRACT_INTERVAL = 4
"""SGLANG_TEST_RETRACT_INTERVAL: retract one request every 4th forward step."""
TIMEOUT_S = 600.0


@dataclass
class Engine:
    engine: Any
    version: int
    checkpoints: dict[int, Path]
    """The checkpoint of each version (0: the one the engine started from)."""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("staleness")
    checkpoints = {v: tiny_checkpoint(root / f"v{v}", seed=v) for v in range(3)}
    env = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": str(RETRACT_INTERVAL)}
    with sglang_engine(
        checkpoints[0],
        env=env,
        custom_weight_loader=[HOOK_PATH],
        # A retracted request is recomputed whole; with the radix cache, a prefix cached
        # before the switch would keep its (correctly reported) old version.
        disable_radix_cache=True,
    ) as engine:
        yield Engine(engine, 0, checkpoints)


def mixed_logits(
    old: Path, new: Path, prompt: list[int], tokens: list[int], switch: int
) -> torch.Tensor:
    """Independently, with transformers: the logits behind ``tokens[switch:]`` when the prompt
    and the tokens sampled before the switch (all but the last) kept the old weights' KV and
    every later position is computed by the new weights (teacher-forced on ``tokens``)."""
    old_model, new_model = (_reference(path) for path in (old, new))
    ids = prompt + tokens
    fed = len(prompt) + switch - 1  # positions [0, fed) hold the old weights' KV
    with torch.no_grad():
        cache = old_model(torch.tensor([ids[:fed]]), use_cache=True).past_key_values
        out = new_model(torch.tensor([ids[fed:-1]]), past_key_values=cache, use_cache=True)
    return out.logits[0]


def _reference(path: Path) -> torch.nn.Module:
    """transformers' model of the checkpoint at ``path``, built from its config and loaded
    with its tensors (strict). Not ``from_pretrained``: in this process (the engine's CPU
    shims installed) it left the rotary embedding's ``inv_freq``, a buffer no checkpoint
    holds, as uninitialized memory: positions went unrotated, and about one run in ten the
    logits were NaN."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    model.load_state_dict(checkpoint_tensors(path), strict=True)
    return model.eval()


NEAR_TIE = 0.05
"""How far below transformers' top logit SGLang's greedy token may be. SGLang's CPU forward
is not transformers' to the last bit: a single-version greedy run of this model took, at one
of 100 tokens, one whose transformers logit was 0.01 below the top (logits are ~0.5 here).
With a wrong KV version, the logits differ by far more, at most tokens."""


def assert_greedy(logits: torch.Tensor, tokens: list[int]) -> None:
    """Each token is the argmax of its transformers logits, up to a near-tie."""
    assert not logits.isnan().any(), "the transformers reference computed NaN"
    for i, (row, token) in enumerate(zip(logits, tokens, strict=True)):
        assert row[token] >= row.max() - NEAR_TIE, (i, token, int(row.argmax()))


async def _apply(served: Engine, version: int) -> None:
    """Apply ``version`` with requests kept in flight (the driver's KEEP mode)."""
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        ContinueGenerationReqInput,
        EndWeightUpdateReqInput,
        PauseGenerationReqInput,
        UpdateWeightsFromTensorReqInput,
        UpdateWeightVersionReqInput,
    )
    from sglang.srt.utils import MultiprocessingSerializer

    manager = served.engine.tokenizer_manager
    named = list(checkpoint_tensors(served.checkpoints[version]).items())
    await manager.pause_generation(PauseGenerationReqInput(mode="in_place"))
    for step in (
        manager.begin_weight_update(BeginWeightUpdateReqInput()),
        manager.update_weights_from_tensor(
            UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=[MultiprocessingSerializer.serialize(named)],
                flush_cache=False,  # SGLang refuses a flush with requests in the batch
            )
        ),
        manager.end_weight_update(EndWeightUpdateReqInput()),
    ):
        success, message = await step
        assert success, message
    await manager.update_weight_version(
        UpdateWeightVersionReqInput(new_version=str(version), abort_all_requests=False)
    )
    await manager.continue_generation(ContinueGenerationReqInput())
    served.version = version


def generate_across_update(
    served: Engine, prompts: Sequence[list[int]], max_new_tokens: int, after_tokens: int
) -> list[tuple[list[int], dict[str, Any]]]:
    """Greedy completions of ``prompts`` (all in flight together); once each has sampled
    ``after_tokens`` tokens, the next version is applied. Returns (tokens, meta_info) each."""
    engine = served.engine
    progress = [0] * len(prompts)

    async def one(index: int, prompt: list[int]) -> tuple[list[int], dict[str, Any]]:
        stream = await engine.async_generate(
            input_ids=prompt, sampling_params=greedy_params(max_new_tokens), stream=True
        )
        tokens: list[int] = []
        meta: dict[str, Any] = {}
        async for chunk in stream:
            tokens = list(chunk["output_ids"])  # cumulative: every token so far
            meta = chunk["meta_info"]
            progress[index] = len(tokens)
        return tokens, meta

    async def scenario() -> list[tuple[list[int], dict[str, Any]]]:
        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
        async with asyncio.timeout(TIMEOUT_S):
            while min(progress) < after_tokens:
                assert not any(t.done() for t in tasks), "a request ended before the update"
                await asyncio.sleep(0.005)
            await _apply(served, served.version + 1)
            return list(await asyncio.gather(*tasks))

    return engine.loop.run_until_complete(scenario())


def _fields(meta: dict[str, Any]) -> tuple[list, list, int]:
    return meta["policy_epoch"], meta["kv_cache_epoch"], meta["num_evictions"]


def test_one_version_single_runs(served: Engine) -> None:
    prompt = [5, 17, 42, 8, 99, 3]
    output = served.engine.generate(input_ids=prompt, sampling_params=greedy_params(12))
    meta = output["meta_info"]
    policy, kv, evictions = _fields(meta)
    v = served.version
    assert len(output["output_ids"]) == 12
    assert policy == [[0, v]] == [list(r) for r in policy_epoch_from_spans(meta["weight_versions"])]
    assert kv == [[0, v]]
    assert expand_runs(kv, len(prompt) + 11) == [v] * (len(prompt) + 11)
    assert evictions == 0 == meta["num_retractions"]


def test_version_applied_mid_request(served: Engine) -> None:
    served.engine.flush_cache()  # no cached prefix from other tests' KV
    prompt = [7, 300, 21, 4, 88, 150, 9, 61]
    old = served.version
    n = 96
    reference = greedy(served.engine, [prompt], n)[0]  # the old version's continuation
    served.engine.flush_cache()

    [(tokens, meta)] = generate_across_update(served, [prompt], n, after_tokens=4)

    policy, kv, evictions = _fields(meta)
    new = served.version
    assert len(tokens) == n
    assert len(policy) == 2 and policy[0] == [0, old] and policy[1][1] == new, policy
    switch = policy[1][0]
    assert 4 <= switch < n
    assert tokens[:switch] == reference[:switch]
    # The prompt and every position fed before the switch keep the old version's KV...
    assert kv == [[0, old], [len(prompt) + switch - 1, new]]
    assert evictions == 0 == meta["num_retractions"]
    # ...which the tokens after the switch show: they are the new weights' over that KV.
    logits = mixed_logits(served.checkpoints[old], served.checkpoints[new], prompt, tokens, switch)
    assert_greedy(logits, tokens[switch:])


def test_retracted_requests_recomputed_under_current_version(served: Engine) -> None:
    served.engine.flush_cache()
    prompts = [[11, 12, 13, 14, 15], [201, 202, 203], [77, 78, 79, 80, 81, 82, 83]]
    old = served.version
    n = 48

    results = generate_across_update(served, prompts, n, after_tokens=3)

    new = served.version
    recomputed = 0
    for prompt, (tokens, meta) in zip(prompts, results, strict=True):
        policy, kv, evictions = _fields(meta)
        assert len(tokens) == n
        assert evictions == meta["num_retractions"]
        switch = policy[-1][0] if policy[-1][1] == new else n
        assert policy in ([[0, old], [switch, new]], [[0, new]]), policy
        kept = [[0, old], [len(prompt) + switch - 1, new]] if switch else [[0, new]]
        # Either the old version's KV stayed, or a retraction after the switch had every
        # position recomputed by the new weights (no radix cache to serve a prefix from).
        assert kv in (kept, [[0, new]]), (policy, kv, evictions)
        if switch >= 2 and kv == [[0, new]]:
            assert evictions > 0, (policy, kv)
            recomputed += 1
    assert recomputed > 0, [_fields(meta) for _, meta in results]


# --- without an engine ------------------------------------------------------------------------


def test_request_epochs_follow_chunks_decodes_and_recomputes() -> None:
    from weightsync.receiver.sglang.staleness import RequestEpochs

    epochs = RequestEpochs(prompt_len=6)
    epochs.compute([], 3, 0)  # first chunk of the prompt: samples nothing
    epochs.compute([0, 0, 0], 6, 1)  # last chunk, under v1: samples token 0
    epochs.decode(6, 1)  # feeds token 0, samples token 1
    epochs.decode(7, 2)
    assert epochs.report(3, 0) == Staleness([(0, 1), (2, 2)], [(0, 0), (3, 1), (7, 2)], 0)
    # Retracted, then recomputed under v3 from a cached prompt prefix (in two chunks).
    epochs.compute([0, 0, 0, 1, 1], 7, 3)  # a chunk: its token was sampled already
    epochs.compute([0, 0, 0, 1, 1, 3, 3], 9, 3)  # samples token 3
    assert epochs.report(4, 1) == Staleness([(0, 1), (2, 2), (3, 3)], [(0, 0), (3, 1), (5, 3)], 1)
    # The report covers the tokens returned: prompt_len + num_tokens - 1 KV positions.
    assert epochs.report(2, 1) == Staleness([(0, 1)], [(0, 0), (3, 1), (5, 3)], 1)


def test_request_epochs_unknown_kv() -> None:
    from weightsync.receiver.sglang.staleness import RequestEpochs

    loaded = RequestEpochs(prompt_len=2)
    loaded.compute([-1], 2, 0)  # a prefix slot no batch here wrote (a host cache's)
    assert loaded.report(1, 0) == Staleness([(0, 0)], None, 0)
    skipped = RequestEpochs(prompt_len=2)
    skipped.compute([], 2, 0)
    skipped.decode(4, 0)  # position 2 and token 1 never seen: no fields at all
    assert skipped.report(1, 0) is None


def test_moved_scheduler_layout_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stands in for a SGLang whose batch moved by removing one field from the real class."""
    from tests.support.sglang import install_cpu_shims

    install_cpu_shims()
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from weightsync.errors import ConfigError
    from weightsync.receiver.sglang import staleness

    monkeypatch.delitem(ScheduleBatch.__dataclass_fields__, "prefix_lens")
    with pytest.raises(ConfigError, match="ScheduleBatch has no field 'prefix_lens'"):
        staleness._install_scheduler_hooks()
