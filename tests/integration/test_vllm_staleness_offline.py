"""Per-token staleness in the offline ``LLM``'s outputs (the in-process engine): the three
attributes on each final ``CompletionOutput``, following the engine's weight-version label."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

from tests.support.vllm import make_llm, random_checkpoint  # noqa: E402
from weightsync.receiver.vllm.staleness import staleness_of  # noqa: E402
from weightsync.staleness import Staleness  # noqa: E402

pytestmark = pytest.mark.vllm


def test_offline_outputs_carry_the_fields(tmp_path):
    from vllm import SamplingParams

    model, _ = random_checkpoint("qwen2", tmp_path / "model")
    llm = make_llm(model, weight_transfer_config={"backend": "weightsync"}, disable_log_stats=False)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=0, ignore_eos=True, n=2)
    prompt = {"prompt_token_ids": [1, 2, 3, 4]}
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert [staleness_of(c) for c in out.outputs] == [Staleness([(0, 0)], [(0, 0)], 0)] * 2
    # The label the drivers set in finish_weight_update (here without new weights).
    llm.llm_engine.set_weight_version("7")
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert [(c.policy_epoch, c.kv_cache_epoch, c.num_evictions) for c in out.outputs] == [
        ([(0, 7)], [(0, 7)], 0)
    ] * 2
