"""CPU-only compatibility shims for importing and building SGLang's model classes in tests.

SGLang 0.5.23 targets CUDA; the test venv (requirements/sglang.txt) runs it on CPU torch. Two
things fail there, and each shim below is the smallest stand-in that lets the REAL classes
import and build. Nothing here runs a forward pass (SGLang's CPU kernels need sgl-kernel's CPU
build, which PyPI does not carry), so no stand-in is ever called.

- ``torchvision``: SGLang imports ``torchvision.transforms`` at import time (InternVL
  preprocessing, via ``sglang.srt.configs``). PyPI's torchvision is CUDA-linked; on CPU torch
  its C++ ops do not load, and its import then dies registering fake kernels for
  ``torchvision::nms``/``qnms``, ops that do not exist. Defining their schemas (no kernels)
  lets the pure-Python parts import; the ops stay unusable.
- ``vllm._custom_ops.rotary_embedding``: on a host that is neither CUDA nor SGLang's CPU
  engine (``SGLANG_USE_CPU_ENGINE=1``, which needs sgl-kernel's CPU ops), ``RotaryEmbedding``
  imports vLLM's kernel as its fallback at construction. It is only stored, never called
  here; the stub raises if it ever is.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch

_TORCHVISION_OPS = {
    "torchvision::nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "torchvision::qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def _define_missing_torchvision_ops() -> None:
    for qualname, schema in _TORCHVISION_OPS.items():
        namespace, name = qualname.split("::")
        if not hasattr(getattr(torch.ops, namespace), name):  # torchvision's C++ ops loaded
            torch.library.define(qualname, schema)


def _rotary_embedding_unavailable(*args: object, **kwargs: object) -> None:
    raise NotImplementedError(
        "tests/sglang/compat.py stands in for vllm._custom_ops.rotary_embedding: SGLang model "
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


def install_cpu_shims() -> None:
    """Install both shims; call before the first ``import sglang``. Idempotent."""
    _define_missing_torchvision_ops()
    _stub_vllm_rotary_kernel()
