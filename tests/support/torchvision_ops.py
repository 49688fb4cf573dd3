"""PyPI's torchvision on CPU torch: define the two op schemas its import needs.

PyPI's torchvision wheels are CUDA-linked (``_C.so`` needs ``libtorch_cuda.so``); on CPU torch
their C++ ops do not load, and ``import torchvision`` then dies registering fake kernels for
``torchvision::nms`` / ``qnms``, ops that do not exist. Defining their schemas (no kernels) lets
the pure-Python parts import (``transforms``: transformers' image processors import it, and
through them vLLM's config module and its Qwen3.5 / Qwen-VL classes, and SGLang's configs); the
ops stay unusable. Call before the first ``import torchvision`` in the process, or install
:func:`define_ops_on_first_import` at interpreter start (vLLM inspects model classes in a
subprocess that imports transformers' image utilities, hence torchvision, before anything else).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

_TORCHVISION_OPS = {
    "torchvision::nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "torchvision::qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def define_missing_torchvision_ops() -> None:
    """Idempotent; a no-op without torchvision, or where its C++ ops load (a CPU build)."""
    import torch  # here, not at module level: the import hook must not load torch at startup

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    try:  # what torchvision's own import does first; defining the schemas would clash with it
        torch.ops.load_library(Path(spec.submodule_search_locations[0]) / "_C.so")
    except OSError:
        pass  # CUDA-linked on CPU torch: the schemas below stand in
    for qualname, schema in _TORCHVISION_OPS.items():
        namespace, name = qualname.split("::")
        if not hasattr(getattr(torch.ops, namespace), name):
            torch.library.define(qualname, schema)


class _DefineOpsOnFirstImport(importlib.abc.MetaPathFinder):
    """Runs :func:`define_missing_torchvision_ops` when ``torchvision`` is first looked up,
    then steps aside: finds nothing, so the normal finders import torchvision."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            define_missing_torchvision_ops()


def define_ops_on_first_import() -> None:
    """For a venv's ``.pth`` line: no import of torch until torchvision is imported."""
    if not any(isinstance(f, _DefineOpsOnFirstImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _DefineOpsOnFirstImport())
