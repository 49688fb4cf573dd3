"""SGLang tests: CPU shims to import SGLang, its REAL model classes built on CPU, the reference
packing of HF tensors into live parameters, and a stand-in SGLang HTTP server.

Imported in the SGLang venv (``.venv-sglang``: its own torch, no vLLM, no megatron) and, for
``FakeSglang``, in the main venv, so it imports neither of the other engines' support.

CPU shims (SGLang 0.5.23 targets CUDA; the SGLang venv, requirements/sglang.txt, runs it on CPU
torch). Two things fail there, and each shim is the smallest stand-in that lets the REAL
classes import and build. Nothing here runs a forward pass (SGLang's CPU kernels need
sgl-kernel's CPU build, which PyPI does not carry), so no stand-in is ever called.

- ``torchvision``: SGLang imports ``torchvision.transforms`` at import time (InternVL
  preprocessing, via ``sglang.srt.configs``); PyPI's CUDA-linked torchvision needs
  ``tests.support.torchvision_ops`` to import on CPU torch.
- ``vllm._custom_ops.rotary_embedding``: on a host that is neither CUDA nor SGLang's CPU
  engine (``SGLANG_USE_CPU_ENGINE=1``, which needs sgl-kernel's CPU ops), ``RotaryEmbedding``
  imports vLLM's kernel as its fallback at construction. It is only stored, never called
  here; the stub raises if it ever is.
- pinned memory: SGLang's LoRA layers and its torch_native LoRA backend allocate pinned host
  tensors unconditionally (``pin_memory=True``, ``.pin_memory()``), which CPU torch refuses
  ("pin_memory=True requires a CUDA or other accelerator backend"). Without an accelerator,
  pinning only speeds up host-to-device copies that never happen, so it becomes a plain
  allocation (``.pin_memory()`` still returns a copy).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import threading
import types
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from tests.support.models import tiny_config
from tests.support.torchvision_ops import define_missing_torchvision_ops
from weightsync.buckets import TensorSpec

# --- CPU shims -------------------------------------------------------------------------------


def _rotary_embedding_unavailable(*args: object, **kwargs: object) -> None:
    raise NotImplementedError(
        "tests/support/sglang.py stands in for vllm._custom_ops.rotary_embedding: SGLang model "
        "forward passes do not run on CPU in these tests"
    )


def _stub_vllm_rotary_kernel() -> None:
    if "vllm" in sys.modules or importlib.util.find_spec("vllm") is not None:
        return  # a real vLLM is installed: use it
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []  # a package, so `vllm._custom_ops` imports
    custom_ops = types.ModuleType("vllm._custom_ops")
    custom_ops.rotary_embedding = _rotary_embedding_unavailable  # type: ignore[attr-defined]
    sys.modules["vllm"] = vllm
    sys.modules["vllm._custom_ops"] = custom_ops


_PINNING_FACTORIES = ("tensor", "empty", "zeros", "ones", "arange", "full")


def _unpinned(factory):
    def allocate(*args, pin_memory: bool = False, **kwargs):
        return factory(*args, **kwargs)

    allocate.__wrapped__ = factory
    return allocate


def _pin_memory_without_accelerator() -> None:
    if torch.accelerator.is_available() or hasattr(torch.Tensor.pin_memory, "__wrapped__"):
        return
    for name in _PINNING_FACTORIES:
        setattr(torch, name, _unpinned(getattr(torch, name)))

    def pin_memory(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return self.clone()

    pin_memory.__wrapped__ = torch.Tensor.pin_memory  # type: ignore[attr-defined]
    torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign]


def install_cpu_shims() -> None:
    """Install the shims; call before the first ``import sglang``. Idempotent."""
    define_missing_torchvision_ops()
    _stub_vllm_rotary_kernel()
    _pin_memory_without_accelerator()


# --- SGLang's model classes on CPU -----------------------------------------------------------

_initialized = False


def init_sglang(world_size: int = 1, rank: int = 0, rendezvous: str | None = None) -> None:
    """A gloo group of ``world_size`` processes, all of one TP group (this one TP rank
    ``rank``), and SGLang's published topology; SGLang layers need both. ``rendezvous``: a
    file every process of the group names (a fresh one by default: world size 1 only)."""
    global _initialized
    if _initialized:
        return
    install_cpu_shims()
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    # A file rendezvous: no port to pick (SGLang's own test helper uses a fixed one).
    store = rendezvous or os.path.join(tempfile.mkdtemp(prefix="ws-sgl-"), "rendezvous")
    init_distributed_environment(
        world_size=world_size,
        rank=rank,
        local_rank=rank,
        backend="gloo",
        distributed_init_method=f"file://{store}",
    )
    # What sglang.test.test_utils.publish_build_topology does (that module imports datasets).
    reset_context()
    publish(
        ServerArgs(model_path="dummy", tp_size=world_size, ep_size=1, pp_size=1),
        role="test",
        ranks=SpawnRanks(world_rank=rank),
    )
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
    initialize_moe_config()
    _initialized = True


def build(arch: str, **fields: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(sglang_model, hf_model)`` for a tiny float32 config of ``arch`` (``fields`` override
    its sizes)."""
    init_sglang()
    import transformers

    if arch == "qwen2":
        from sglang.srt.models.qwen2 import Qwen2ForCausalLM as Sgl
    elif arch == "llama":
        from sglang.srt.models.llama import LlamaForCausalLM as Sgl
    elif arch == "qwen3":
        from sglang.srt.models.qwen3 import Qwen3ForCausalLM as Sgl
    elif arch == "qwen3_moe":
        from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM as Sgl
    else:
        raise ValueError(f"unknown arch {arch!r}")
    config = tiny_config(arch, **fields)
    config.dtype = torch.float32
    hf_cls = getattr(transformers, config.architectures[0])
    torch.manual_seed(0)
    return Sgl(config), hf_cls(config)


def checkpoint_specs(hf_model: torch.nn.Module) -> list[TensorSpec]:
    """The HF checkpoint names and shapes (per-expert names, as checkpoints store them).

    transformers 5 keeps experts fused in memory (``experts.gate_up_proj``: ``[E, 2I, H]``)
    and splits them per expert only when saving; the sender publishes the saved form.
    """
    specs = []
    for name, t in hf_model.state_dict().items():
        head, _, leaf = name.rpartition("experts.")
        if leaf == "gate_up_proj":
            num_experts, rows, cols = t.shape
            for e in range(num_experts):
                for which in ("gate_proj", "up_proj"):
                    specs.append(
                        TensorSpec(
                            f"{head}experts.{e}.{which}.weight", "float32", (rows // 2, cols)
                        )
                    )
        elif leaf == "down_proj":
            num_experts, rows, cols = t.shape
            specs.extend(
                TensorSpec(f"{head}experts.{e}.down_proj.weight", "float32", (rows, cols))
                for e in range(num_experts)
            )
        else:
            specs.append(TensorSpec.of(name, t))
    return specs


_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def expected_live(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What every live SGLang parameter must hold, packed by hand from HF tensors (TP=1).

    Independent of SGLang's loaders: qkv = cat(q, k, v); gate_up = cat(gate, up); fused
    experts w13[e] = cat(gate_e, up_e), w2[e] = down_e.
    """
    slices: dict[str, dict[tuple[int, int], torch.Tensor]] = {}  # live -> (expert, slot) -> t
    out: dict[str, torch.Tensor] = {}
    for name, t in checkpoint.items():
        pieces = name.split(".")
        if "experts" in pieces and pieces[pieces.index("experts") + 1].isdigit():
            i = pieces.index("experts")
            expert, which = int(pieces[i + 1]), pieces[i + 2]
            base = ".".join(pieces[: i + 1])
            live = f"{base}.w2_weight" if which == "down_proj" else f"{base}.w13_weight"
            slices.setdefault(live, {})[(expert, int(which == "up_proj"))] = t
        elif len(pieces) >= 2 and pieces[-2] in _PACKED:
            packed, index = _PACKED[pieces[-2]]
            live = ".".join([*pieces[:-2], packed, pieces[-1]])
            slices.setdefault(live, {})[(-1, index)] = t
        else:
            out[name] = t
    for live, by_key in slices.items():
        experts = sorted({e for e, _ in by_key})
        rows = [torch.cat([by_key[k] for k in sorted(by_key) if k[0] == e]) for e in experts]
        out[live] = rows[0] if experts == [-1] else torch.stack(rows)
    return out


# --- a stand-in SGLang HTTP server -----------------------------------------------------------


UPDATE_ROUTES = [
    "/pause_generation",
    "/begin_weight_update",
    "/update_weights_from_tensor",
    "/end_weight_update",
    "/flush_cache",
    "/update_weight_version",
    "/continue_generation",
]
"""The SGLang routes one weight update calls, in order (one bucket, no memory release)."""


class FakeSglang:
    """A local HTTP server answering like SGLang 0.5.23's routes (status 400 with
    {"success": false, "message"} on failure); records (route, body). ``fail[route]`` makes
    that route answer HTTP 400. A context manager that closes the server."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.fail: dict[str, str] = {}
        self.soft_fail: dict[str, str] = {}
        """Routes answering 200 with {"success": false} (some SGLang routes do)."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                fake.requests.append((self.path, body))
                if self.path in fake.fail:
                    self._answer(400, {"success": False, "message": fake.fail[self.path]})
                elif self.path in fake.soft_fail:
                    self._answer(200, {"success": False, "message": fake.soft_fail[self.path]})
                elif self.path == "/release_memory_occupation":
                    self._answer(200, None)  # SGLang's route returns nothing on success
                else:
                    self._answer(200, {"success": True, "message": "ok"})

            def _answer(self, status: int, content: object) -> None:
                data = json.dumps(content).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        ).start()

    def routes(self) -> list[str]:
        return [route for route, _ in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FakeSglang:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- MTP: a target model and its draft model ------------------------------------------------


def draft_pair(build: Callable[[bool], torch.nn.Module]) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The target model (``build(False)``) and its draft model (``build(True)``), which serves
    the target's embedding and lm_head as SGLang's speculative worker arranges
    (``set_embed_and_head``, less its CUDA calls)."""
    main, draft = build(False), build(True)
    del draft.model.embed_tokens.weight, draft.lm_head.weight
    draft.model.embed_tokens.weight = main.model.embed_tokens.weight
    draft.lm_head.weight = main.lm_head.weight
    return main, draft


def sglang_load(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``model`` loaded by SGLang's own loader from ``tensors``."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    with torch.no_grad():
        DefaultModelLoader.load_weights_and_postprocess(
            model, ((n, t.clone()) for n, t in tensors.items()), torch.device("cpu")
        )
    return model


def check_target_and_draft(
    build: Callable[[bool], torch.nn.Module],
    tensors: dict[str, torch.Tensor],
    bad: tuple[str, str],
    refusal: str,
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A version through ``SglangWeightTarget(main, draft=...)`` leaves both models equal to
    SGLang's own load of ``tensors``; a next version adding ``bad`` (an unknown name, and the
    name of the tensor it copies) is refused (``NameResolutionError`` matching ``refusal``)
    without a write. Returns the models."""
    from tests.support import drive, manifest_of
    from tests.sweeps.archs import BUCKET_BYTES, differing, live_tensors
    from weightsync.errors import NameResolutionError
    from weightsync.receiver.sglang.target import SglangWeightTarget

    main, draft = draft_pair(build)
    target = SglangWeightTarget(main, "cpu", draft=draft)
    drive(target, manifest_of(1, tensors), tensors, BUCKET_BYTES)
    want_main, want_draft = draft_pair(build)
    for got, want in (
        (main, sglang_load(want_main, tensors)),
        (draft, sglang_load(want_draft, tensors)),
    ):
        wrong = differing(live_tensors(got).items(), live_tensors(want).items())
        assert not wrong, f"{len(wrong)} tensors differ from SGLang's own load: {wrong[:4]}"
    bad_name, like = bad
    bad_version = {**tensors, bad_name: tensors[like]}
    before = {n: t.clone() for n, t in {**live_tensors(main), **live_tensors(draft)}.items()}
    with pytest.raises(NameResolutionError, match=refusal):
        drive(target, manifest_of(2, bad_version), bad_version, BUCKET_BYTES)
    after = {**live_tensors(main), **live_tensors(draft)}
    assert not differing(after.items(), before.items()), "a refused version wrote"
    return main, draft
