"""A running SGLang engine on CPU for tests: the offline ``sglang.Engine`` (tokenizer manager in
this process; scheduler and detokenizer in spawned child processes) over a tiny local
checkpoint with random weights.

Usage (one engine per test module: it takes minutes to start on a loaded 2-core box)::

    @pytest.fixture(scope="module")
    def engine(tmp_path_factory):
        path = tiny_checkpoint(tmp_path_factory.mktemp("model"))
        with sglang_engine(path, env={"SGLANG_TEST_RETRACT": "1"}, enable_lora=True) as e:
            yield e

    tokens = greedy(engine, [[1, 2, 3]], max_new_tokens=8)[0]

``sglang_engine`` passes its keyword arguments to ``sglang.Engine`` (any ``ServerArgs`` field:
``custom_weight_loader=[...]``, ``enable_lora=True``, ``max_total_tokens=...``) over CPU
defaults (:data:`CPU_ARGS`). ``env`` is set while the engine starts, so the spawned processes
read it (SGLang's ``SGLANG_*`` switches, ``WEIGHTSYNC_ADDRESS``...); this process's environment
is restored afterwards.

Child processes get the CPU shims (``tests.support.sglang.install_cpu_shims``) through
``tests/support/sglang_boot/sitecustomize.py``, which Python imports at startup when that folder
is on ``PYTHONPATH``: SGLang spawns its children (``multiprocessing`` "spawn"), which re-import
everything, so shims installed in this process alone would not reach them.

Shutdown is SGLang's ``Engine.shutdown``, which kills every child process of THIS process (not
only the engine's); the context manager then waits until the engine's own children are gone.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

from tests.support.models import tiny_config
from tests.support.sglang import install_cpu_shims

SHIMS_ENV = "WEIGHTSYNC_TEST_SGLANG_SHIMS"
"""Set to "1" in the engine's children: ``sitecustomize`` then installs the CPU shims."""

BOOT_DIR = Path(__file__).parent / "sglang_boot"
"""Holds the ``sitecustomize.py`` the children import at startup."""

CPU_ARGS: dict[str, Any] = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "dtype": "float32",
    "skip_tokenizer_init": True,  # requests are token ids; the tiny checkpoint has no tokenizer
    "disable_cuda_graph": True,
    "random_seed": 0,
    "max_total_tokens": 4096,  # the KV pool; SGLang would size it from the host's memory
    "log_level": "error",
}
"""What a CPU engine needs; ``sglang_engine``'s keyword arguments override them."""

EXIT_TIMEOUT_S = 900.0
"""How long the children may take to exit after shutdown (generous: the box is loaded)."""


def tiny_checkpoint(directory: str | Path, arch: str = "llama", seed: int = 0) -> Path:
    """Save a tiny ``arch`` model (``tests.support.models.tiny_config``, float32, random weights
    from ``seed``) as a Hugging Face checkpoint in ``directory``; returns the directory."""
    install_cpu_shims()  # transformers imports torchvision too
    import transformers

    config = tiny_config(arch)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config)
    model.save_pretrained(directory)
    return Path(directory)


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def child_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables the engine's children start with: ``env``, the shims switch, and
    ``PYTHONPATH`` led by the ``sitecustomize`` folder and the repository root."""
    root = str(BOOT_DIR.parent.parent.parent)
    path = [str(BOOT_DIR), root, *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    return {**(env or {}), SHIMS_ENV: "1", "PYTHONPATH": ":".join(path)}


@contextlib.contextmanager
def sglang_engine(
    model_path: str | Path, *, env: Mapping[str, str] | None = None, **server_args: Any
) -> Iterator[Any]:
    """A started ``sglang.Engine`` on ``model_path``, shut down (children gone) on exit.

    Args:
        model_path: a checkpoint folder (:func:`tiny_checkpoint`).
        env: environment for the engine's processes, set only while it starts.
        server_args: ``ServerArgs`` fields over :data:`CPU_ARGS`.
    """
    install_cpu_shims()
    import sglang
    from sglang.srt.runtime_context import ParallelContext, RuntimeContext, use_context

    before = {child.pid for child in psutil.Process().children(recursive=True)}
    engine = None
    # The engine publishes its server args (device "cpu"...) process-wide: in a context of its
    # own, model classes built in this process after it see the one the tests published.
    with use_context(RuntimeContext(parallel=ParallelContext())):
        try:
            with _environment(child_environment(env)):
                engine = sglang.Engine(model_path=str(model_path), **{**CPU_ARGS, **server_args})
            yield engine
        finally:
            if engine is not None:
                engine.shutdown()
            # A failed start leaves children too; SGLang's shutdown kills them only when it ran.
            spawned = [
                child
                for child in psutil.Process().children(recursive=True)
                if child.pid not in before
            ]
            for child in spawned:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            psutil.wait_procs(spawned, timeout=EXIT_TIMEOUT_S)


def greedy(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    lora_path: str | None = None,
    **sampling: Any,
) -> list[list[int]]:
    """Greedy completions (token ids) of ``prompts``, ignoring end-of-sequence tokens so each
    has exactly ``max_new_tokens``; with ``lora_path``, served with that LoRA adapter (its
    registered name)."""
    outputs = engine.generate(
        input_ids=[list(p) for p in prompts],
        sampling_params=greedy_params(max_new_tokens, **sampling),
        lora_path=None if lora_path is None else [lora_path] * len(prompts),
    )
    return [list(output["output_ids"]) for output in outputs]


def greedy_params(max_new_tokens: int, **sampling: Any) -> dict[str, Any]:
    """SGLang sampling parameters for a greedy completion of exactly ``max_new_tokens``."""
    return {
        "temperature": 0.0,
        "max_new_tokens": max_new_tokens,
        "ignore_eos": True,
        **sampling,
    }
