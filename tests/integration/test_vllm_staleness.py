"""Per-token staleness through a real ``vllm serve`` (multiprocess engine): long greedy
completions stay in flight while a new version is applied with ``pause_mode="keep"``, and each
choice reports ``policy_epoch``, ``kv_cache_epoch`` and ``num_evictions``, checked against
transformers' greedy continuations under each version.

One server for the module; its KV cache holds 192 tokens, six blocks of 32 (one request fits,
four do not), so four concurrent requests are preempted and recomputed. Prefix caching is off:
with it, vLLM may reuse a preempted request's old-version blocks, which the API server cannot
see (docs/staleness.md)."""

from __future__ import annotations

import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

import requests  # noqa: E402

from tests.support import random_weights, unix_sender, wait_until  # noqa: E402
from tests.support.vllm import random_checkpoint, save_checkpoint, vllm_server  # noqa: E402
from weightsync.drivers.vllm import VllmServerClient, publish_to_vllm  # noqa: E402
from weightsync.receiver.vllm.staleness import FIELDS, MAX_POLICY_LAG_ARG  # noqa: E402
from weightsync.sender import Publisher  # noqa: E402

pytestmark = pytest.mark.vllm

KIND = "llama"
PROMPTS = ((1, 2, 3, 4), (17, 99, 250, 3), (400, 7, 8, 9), (5, 6, 7, 300))
P = 4
"""Every prompt's length."""
MAX_TOKENS = 96
KV_CACHE_TOKENS = 192
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4
"""K and V, 2 layers, 2 KV heads, head_dim 32, float32."""
SWITCH_AFTER_TOKENS = 6
"""Apply the new version once every in-flight request has about this many tokens."""


def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer beside the checkpoint (``"t17"`` is token 17) with a chat
    template that joins the messages' contents, so chat requests have known prompt ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    # Special tokens are matched inside words, so none may prefix another token ("t2" would).
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)


@dataclass
class Server:
    root: Path
    base_url: str
    model: str
    template: dict[str, torch.Tensor]
    address: str
    version: int = 0
    weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    _hf: dict[int, torch.nn.Module] = field(default_factory=dict)

    def publish(self, keep_kv: bool) -> int:
        """Apply the next version (random weights) with in-flight requests kept."""
        version = self.version + 1
        weights = random_weights(self.template, seed=700 + version)
        client = VllmServerClient(self.base_url, pause_mode="keep", keep_kv=keep_kv)
        with Publisher(self.address) as publisher:
            publish_to_vllm(publisher, weights, version, [client], timeout_s=120)
        self.version, self.weights[version] = version, weights
        return version

    def greedy(self, version: int, prompt: list[int], n: int) -> list[int]:
        """transformers' greedy continuation of ``prompt`` under ``version``."""
        if version not in self._hf:
            from transformers import AutoModelForCausalLM

            path = save_checkpoint(KIND, self.root / f"hf{version}", self.weights[version])
            self._hf[version] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model, ids, out = self._hf[version].eval(), torch.tensor([prompt]), []
        with torch.no_grad():
            past = None
            for _ in range(n):
                result = model(ids, past_key_values=past, use_cache=True)
                past, ids = result.past_key_values, result.logits[:, -1:].argmax(-1)
                out.append(int(ids))
        return out

    def complete(self, prompt: tuple[int, ...], max_tokens: int = MAX_TOKENS, **extra) -> dict:
        body = {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            **extra,
        }
        response = requests.post(f"{self.base_url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        return response.json()["choices"][0]

    def generated_tokens(self) -> float:
        text = requests.get(f"{self.base_url}/metrics", timeout=10).text
        return sum(
            map(float, re.findall(r"^vllm:generation_tokens_total\{.*\} (\S+)$", text, re.M))
        )

    def in_flight(self, prompts, switch: callable, extras=None) -> list[dict]:
        """Send ``prompts`` at once (with ``extras[i]`` in request i's body); once they have
        generated a few tokens, ``switch()``; return their choices."""
        start = self.generated_tokens()
        extras = extras or [{}] * len(prompts)
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures: list[Future] = [
                pool.submit(self.complete, p, **e) for p, e in zip(prompts, extras, strict=True)
            ]
            wait_until(
                lambda: self.generated_tokens() - start >= SWITCH_AFTER_TOKENS * len(prompts),
                60, "requests generating", interval=0.005,
            )  # fmt: skip
            switch()
            return [f.result() for f in futures]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("staleness")
    model, template = random_checkpoint(KIND, root / "model")
    save_tokenizer(model)
    with unix_sender(bucket_size_bytes=64 * 1024, ack_timeout_s=120) as sender:
        extra = (
            "--kv-cache-memory-bytes", str(KV_CACHE_TOKENS * KV_BYTES_PER_TOKEN),
            "--block-size", "32", "--no-enable-prefix-caching", "--no-skip-tokenizer-init",
        )  # fmt: skip
        with vllm_server(model, root / "server.log", *extra) as base_url:
            server = Server(root, base_url, str(model), template, sender.address)
            server.weights[0] = random_weights(template, seed=0)
            VllmServerClient(base_url).init(sender.address, receiver_id="staleness")
            yield server


def switch_index(choice: dict, old: int, new: int) -> int:
    """Where ``policy_epoch`` switches from ``old`` to ``new`` (it must switch once)."""
    (first, old_seen), (k, new_seen) = choice["policy_epoch"]
    assert (first, old_seen, new_seen) == (0, old, new), choice["policy_epoch"]
    assert 0 < k < MAX_TOKENS, f"the update did not land while the request was in flight: {k}"
    return k


def test_one_version_one_run_and_only_three_new_fields(server):
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseChoice

    choice = server.complete(PROMPTS[0], max_tokens=8, logprobs=1)
    v = server.version
    assert choice["policy_epoch"] == [[0, v]]
    assert choice["kv_cache_epoch"] == [[0, v]]
    assert choice["num_evictions"] == 0
    assert choice["token_ids"] == server.greedy(v, list(PROMPTS[0]), 8)
    assert len(choice["logprobs"]["token_logprobs"]) == 8
    assert set(choice) - set(CompletionResponseChoice.model_fields) == set(FIELDS)


def test_chat_choices_carry_the_fields(server):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponseChoice

    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": " ".join(f"t{t}" for t in PROMPTS[1])}],
        "max_tokens": 6,
        "n": 2,  # two choices (vLLM refuses n > 1 with greedy sampling)
        "temperature": 1.0,
        "seed": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    assert response.json()["prompt_token_ids"] == list(PROMPTS[1])
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice in choices:
        assert len(choice["token_ids"]) == 6
        assert choice["policy_epoch"] == [[0, server.version]]
        assert choice["kv_cache_epoch"] == [[0, server.version]]
        assert choice["num_evictions"] == 0
        assert set(choice) - set(ChatCompletionResponseChoice.model_fields) == set(FIELDS)


def test_switch_in_flight_keeps_old_kv(server):
    old = server.version
    (choice,) = server.in_flight(PROMPTS[:1], lambda: server.publish(keep_kv=True))
    new = server.version
    k = switch_index(choice, old, new)
    tokens = choice["token_ids"]
    assert tokens[:k] == server.greedy(old, list(PROMPTS[0]), k)
    # Token k was the first sampled under the new weights; that step computed position P+k-1.
    assert choice["kv_cache_epoch"] == [[0, old], [P + k - 1, new]], choice
    assert choice["num_evictions"] == 0
    after = server.complete(PROMPTS[1], max_tokens=4)
    assert (after["policy_epoch"], after["kv_cache_epoch"]) == ([[0, new]], [[0, new]])


def test_cleared_kv_recomputes_everything_under_the_new_version(server):
    old = server.version
    (choice,) = server.in_flight(PROMPTS[:1], lambda: server.publish(keep_kv=False))
    new = server.version
    k = switch_index(choice, old, new)
    tokens = choice["token_ids"]
    assert tokens[:k] == server.greedy(old, list(PROMPTS[0]), k)
    # Every position was recomputed by the new weights: the rest is the new version's greedy
    # continuation of the prompt and the old tokens.
    assert tokens[k:] == server.greedy(new, [*PROMPTS[0], *tokens[:k]], MAX_TOKENS - k)
    assert choice["kv_cache_epoch"] == [[0, new]]
    assert choice["num_evictions"] == 1


def test_preempted_requests_recompute_under_the_new_version(server):
    old = server.version
    choices = server.in_flight(PROMPTS, lambda: server.publish(keep_kv=True))
    new = server.version
    evicted = 0
    for prompt, choice in zip(PROMPTS, choices, strict=True):
        k = switch_index(choice, old, new)
        assert choice["token_ids"][:k] == server.greedy(old, list(prompt), k)
        if choice["num_evictions"]:
            evicted += 1
            # Preempted after the update (the cache fills only later): all KV recomputed.
            assert choice["kv_cache_epoch"] == [[0, new]], choice
        else:
            assert choice["kv_cache_epoch"] == [[0, old], [P + k - 1, new]], choice
    assert evicted > 0, "the KV cache did not force a preemption"


def test_requests_over_their_staleness_bound_end(server):
    old = server.version
    bounded = {"vllm_xargs": {MAX_POLICY_LAG_ARG: 0}}
    choices = server.in_flight(
        PROMPTS[:2], lambda: server.publish(keep_kv=True), extras=[bounded, {}]
    )
    new = server.version
    ended, free = choices
    # Ended before sampling under the new version: every token it has is the old version's.
    n = len(ended["token_ids"])
    assert ended["finish_reason"] == "abort" and 0 < n < MAX_TOKENS, ended
    assert ended["policy_epoch"] == [[0, old]]
    assert ended["token_ids"] == server.greedy(old, list(PROMPTS[0]), n)
    assert free["finish_reason"] == "length"
    switch_index(free, old, new)
    # A bound of 0 is met by a request served under one version.
    after = server.complete(PROMPTS[2], max_tokens=4, **bounded)
    assert after["finish_reason"] == "length" and after["policy_epoch"] == [[0, new]]
    with pytest.raises(requests.HTTPError, match="400") as refused:
        server.complete(PROMPTS[2], max_tokens=4, vllm_xargs={MAX_POLICY_LAG_ARG: -1})
    assert f"{MAX_POLICY_LAG_ARG} must be an integer >= 0, got -1" in refused.value.response.text


def test_hooks_refuse_a_vllm_layout_they_do_not_know():
    from weightsync.errors import ConfigError
    from weightsync.receiver.vllm import staleness

    class Moved:
        def process(self, outputs): ...

    with pytest.raises(ConfigError, match=r"Moved\.process_outputs is missing"):
        staleness._patch(Moved, "process_outputs", lambda f: f)
    with pytest.raises(ConfigError, match=r"Moved\.process lacks parameter\(s\) \['weight_ver"):
        staleness._patch(Moved, "process", lambda f: f, ("outputs", "weight_version"))
