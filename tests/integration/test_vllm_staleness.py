"""Per-token staleness through a real ``vllm serve`` (multiprocess engine): long greedy
completions stay in flight while a new version is applied with ``pause_mode="keep"``, and each
choice reports ``policy_epoch``, ``kv_cache_epoch`` and ``num_evictions``, checked against
transformers' greedy continuations under each version.

The TP=1 server this module shares (``tests.support.vllm.SERVER_TP1``), on this module's own
sender, which applies version 1 before the first test; its KV cache holds 192 tokens, six blocks
of 32 (one request fits, four do not), so four concurrent requests are preempted and
recomputed. Prefix caching is off: with it, vLLM may reuse a preempted request's old-version
blocks, which the API server cannot see (docs/staleness.md). Streamed responses are read back
as the non-streamed ones, and must carry the same fields, on each choice's final chunk only."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

import requests  # noqa: E402

from tests.support import random_weights, unix_sender, wait_until  # noqa: E402
from tests.support.vllm import SERVER_TP1, save_checkpoint  # noqa: E402
from weightsync.drivers.vllm import VllmServerClient, publish_to_vllm  # noqa: E402
from weightsync.receiver.vllm.staleness import FIELDS, MAX_POLICY_LAG_ARG  # noqa: E402
from weightsync.receiver.vllm.staleness_openai import SSE_DATA, SSE_END, with_fields  # noqa: E402
from weightsync.sender import Publisher  # noqa: E402

pytestmark = [pytest.mark.vllm, SERVER_TP1.mark]

KIND = SERVER_TP1.kind
PROMPTS = ((1, 2, 3, 4), (17, 99, 250, 3), (400, 7, 8, 9), (5, 6, 7, 300))
P = 4
"""Every prompt's length."""
MAX_TOKENS = 96
SWITCH_AFTER_TOKENS = 6
"""Apply the new version once every in-flight request has about this many tokens."""


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

    def body(self, prompt: tuple[int, ...], max_tokens: int = MAX_TOKENS, **extra) -> dict:
        """A greedy completion request; ``chat=True``: the chat request with the same prompt
        ids (the template joins the messages' contents)."""
        chat = extra.pop("chat", False)
        if chat:
            text = " ".join(f"t{t}" for t in prompt)
            extra["messages"] = [{"role": "user", "content": text}]
        else:
            extra["prompt"] = list(prompt)
        return {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            **extra,
        }

    def complete(self, prompt: tuple[int, ...], max_tokens: int = MAX_TOKENS, **extra) -> dict:
        body = self.body(prompt, max_tokens, **extra)
        response = requests.post(f"{self.base_url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        return response.json()["choices"][0]

    def stream(self, body: dict) -> dict[int, list[dict]]:
        """``body`` (a chat request if it has messages) sent with ``"stream": true``: each
        choice's chunks, by index, in the order they came."""
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        chunks: dict[int, list[dict]] = {}
        with requests.post(
            f"{self.base_url}{route}", json={**body, "stream": True}, stream=True, timeout=120
        ) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line and line != b"data: [DONE]":
                    assert line.startswith(SSE_DATA.encode()), line
                    for choice in json.loads(line[len(SSE_DATA) :])["choices"]:
                        chunks.setdefault(choice["index"], []).append(choice)
        return chunks

    def generated_tokens(self) -> float:
        text = requests.get(f"{self.base_url}/metrics", timeout=10).text
        return sum(
            map(float, re.findall(r"^vllm:generation_tokens_total\{.*\} (\S+)$", text, re.M))
        )

    def in_flight(self, calls: list[Callable[[], object]], switch: Callable[[], object]) -> list:
        """Make the request ``calls`` at once; once they have generated a few tokens,
        ``switch()``; return their results."""
        start = self.generated_tokens()
        with ThreadPoolExecutor(len(calls)) as pool:
            futures: list[Future] = [pool.submit(call) for call in calls]
            wait_until(
                lambda: self.generated_tokens() - start >= SWITCH_AFTER_TOKENS * len(calls),
                60, "requests generating", interval=0.005,
            )  # fmt: skip
            switch()
            return [f.result() for f in futures]


@pytest.fixture(scope="module")
def server(request, vllm_servers, tmp_path_factory):
    """The shared server on this module's sender, at version 1 (the versions other modules
    applied came from their own senders)."""
    served = vllm_servers.get(SERVER_TP1, request.node)
    root = tmp_path_factory.mktemp("staleness")
    with unix_sender(bucket_size_bytes=64 * 1024, ack_timeout_s=120) as sender:
        server = Server(root, served.base_url, served.model, served.template, sender.address)
        VllmServerClient(served.base_url).init(sender.address, receiver_id="staleness")
        assert server.publish(keep_kv=False) == 1
        yield server


def switch_index(choice: dict, old: int, new: int) -> int:
    """Where ``policy_epoch`` switches from ``old`` to ``new`` (it must switch once)."""
    (first, old_seen), (k, new_seen) = choice["policy_epoch"]
    assert (first, old_seen, new_seen) == (0, old, new), choice["policy_epoch"]
    assert 0 < k < MAX_TOKENS, f"the update did not land while the request was in flight: {k}"
    return k


def assert_switched(
    server: Server, choice: dict, prompt: tuple[int, ...], old: int, new: int
) -> bool:
    """The fields of a choice in flight while ``new`` replaced ``old`` with its KV kept, checked
    against the old version's greedy tokens; returns whether it was evicted (after the update:
    the cache fills only later), which recomputes all its KV under ``new``."""
    k = switch_index(choice, old, new)
    assert choice["token_ids"][:k] == server.greedy(old, list(prompt), k)
    if choice["num_evictions"]:
        assert choice["kv_cache_epoch"] == [[0, new]], choice
    else:
        # Token k was the first sampled under the new weights; that step computed position P+k-1.
        assert choice["kv_cache_epoch"] == [[0, old], [P + k - 1, new]], choice
    return choice["num_evictions"] > 0


def joined(chunks: list[dict], model: type) -> dict:
    """One streamed choice read as its non-streamed form: token ids joined, and the fields,
    which only its final chunk (the one with ``finish_reason``, the last) carries; every other
    chunk has only ``model``'s fields, as without weightsync."""
    *before, final = chunks
    for chunk in before:
        assert chunk.get("finish_reason") is None and set(chunk) <= set(model.model_fields), chunk
    assert final["finish_reason"] is not None, final
    assert set(final) - set(model.model_fields) == set(FIELDS), final
    tokens = [t for chunk in chunks for t in chunk.get("token_ids") or ()]
    return {"token_ids": tokens, **{name: final[name] for name in FIELDS}}


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

    # Two choices (vLLM refuses n > 1 with greedy sampling).
    body = server.body(PROMPTS[1], 6, chat=True, n=2, temperature=1.0, seed=0)
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


def test_streamed_choices_carry_the_fields_on_their_final_chunk(server):
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
    )
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice

    v = server.version
    (chunks,) = server.stream(server.body(PROMPTS[0], 8, logprobs=1)).values()
    assert len(chunks) > 2, "not streamed token by token"
    choice = joined(chunks, CompletionResponseStreamChoice)
    assert choice["token_ids"] == server.greedy(v, list(PROMPTS[0]), 8)
    assert [choice[name] for name in FIELDS] == [[[0, v]], [[0, v]], 0]
    # Two prompts in one request: the second's choice is numbered 1.
    body = {**server.body(PROMPTS[0], 4), "prompt": [list(PROMPTS[0]), list(PROMPTS[2])]}
    streamed = server.stream(body)
    assert sorted(streamed) == [0, 1]
    for prompt, chunks in zip((PROMPTS[0], PROMPTS[2]), (streamed[0], streamed[1]), strict=True):
        choice = joined(chunks, CompletionResponseStreamChoice)
        assert choice["token_ids"] == server.greedy(v, list(prompt), 4)
        assert [choice[name] for name in FIELDS] == [[[0, v]], [[0, v]], 0]
    streamed = server.stream(server.body(PROMPTS[1], 6, chat=True, n=2, temperature=1.0, seed=0))
    assert sorted(streamed) == [0, 1]
    for chunks in streamed.values():
        choice = joined(chunks, ChatCompletionResponseStreamChoice)
        assert len(choice["token_ids"]) == 6
        assert [choice[name] for name in FIELDS] == [[[0, v]], [[0, v]], 0]


def test_streamed_switch_in_flight_gives_the_non_streamed_fields(server):
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
    )
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice

    old = server.version
    cases = (
        (PROMPTS[0], server.body(PROMPTS[0]), CompletionResponseStreamChoice),
        (PROMPTS[1], server.body(PROMPTS[1], chat=True), ChatCompletionResponseStreamChoice),
    )
    streams = server.in_flight(
        [partial(server.stream, body) for _, body, _ in cases],
        partial(server.publish, keep_kv=True),
    )
    new = server.version
    for (prompt, _, model), streamed in zip(cases, streams, strict=True):
        (chunks,) = streamed.values()
        choice = joined(chunks, model)
        assert len(choice["token_ids"]) == MAX_TOKENS
        assert_switched(server, choice, prompt, old, new)


def test_final_chunks_alone_gain_the_fields():
    def event(chunk: dict) -> str:
        return f"{SSE_DATA}{json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}{SSE_END}"

    fields = {"policy_epoch": [[0, 1], [3, 2]], "kv_cache_epoch": [[0, 1]], "num_evictions": 0}
    finished = {1: fields}
    untouched = [
        event({"choices": [{"index": 1, "text": "a", "finish_reason": None}]}),
        event({"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}),
        event({"error": {"message": "boom"}}),
        f"{SSE_DATA}[DONE]{SSE_END}",
    ]
    for e in untouched:
        assert with_fields(e, finished) is e
    final = {"id": "x", "choices": [{"index": 1, "text": "ü", "finish_reason": "stop"}]}
    out = with_fields(event(final), finished)
    final["choices"][0].update(fields)
    assert out == event(final)  # compact, unescaped: the form vLLM wrote
    assert finished == {}, "a choice's fields go on one chunk only"


def test_switch_in_flight_keeps_old_kv(server):
    old = server.version
    (choice,) = server.in_flight(
        [partial(server.complete, PROMPTS[0])], partial(server.publish, keep_kv=True)
    )
    new = server.version
    assert not assert_switched(server, choice, PROMPTS[0], old, new)
    after = server.complete(PROMPTS[1], max_tokens=4)
    assert (after["policy_epoch"], after["kv_cache_epoch"]) == ([[0, new]], [[0, new]])


def test_cleared_kv_recomputes_everything_under_the_new_version(server):
    old = server.version
    (choice,) = server.in_flight(
        [partial(server.complete, PROMPTS[0])], partial(server.publish, keep_kv=False)
    )
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
    choices = server.in_flight(
        [partial(server.complete, p) for p in PROMPTS], partial(server.publish, keep_kv=True)
    )
    new = server.version
    evicted = [
        assert_switched(server, c, p, old, new) for p, c in zip(PROMPTS, choices, strict=True)
    ]
    assert any(evicted), "the KV cache did not force a preemption"


def test_requests_over_their_staleness_bound_end(server):
    old = server.version
    bounded = {"vllm_xargs": {MAX_POLICY_LAG_ARG: 0}}
    choices = server.in_flight(
        [partial(server.complete, PROMPTS[0], **bounded), partial(server.complete, PROMPTS[1])],
        partial(server.publish, keep_kv=True),
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
    from weightsync.receiver.vllm import staleness, staleness_openai

    class Moved:
        def process(self, outputs): ...

        def stream(self, request, result_generator): ...

    with pytest.raises(ConfigError, match=r"Moved\.process_outputs is missing"):
        staleness._patch(Moved, "process_outputs", lambda f: f)
    with pytest.raises(ConfigError, match=r"Moved\.process lacks parameter\(s\) \['weight_ver"):
        staleness._patch(Moved, "process", lambda f: f, ("outputs", "weight_version"))
    with pytest.raises(ConfigError, match=r"Moved\.stream is no longer an async generator"):
        staleness_openai._patch_stream(Moved, "stream", staleness_openai._chat_outputs)
