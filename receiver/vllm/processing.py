"""Which of a vLLM model's layers serve their weights exactly as the loaders wrote them: those a
version may replay straight into (:mod:`weightsync.receiver.replay`). Every other layer is
processed after loading (quantized, repacked for vLLM-CPU's GEMMs, its MoE kernel rebuilt,
weights derived from it as MLA attention derives its own from ``kv_b_proj``) and takes vLLM's
layerwise reload, which runs that processing again.
"""

from __future__ import annotations

import torch

from weightsync.receiver.replay import modules_as_loaded


def _as_loaded_methods(cuda: bool | None) -> tuple[type, ...]:
    """The quantization methods whose ``process_weights_after_loading`` leaves the weights as
    they are on CUDA (``cuda`` None: on this platform): the unquantized linear and embedding
    ones (on CPU they repack, on XPU they may transpose; the fused-MoE one builds backend
    kernels that may shuffle). Exact types: a subclass may process."""
    from vllm.platforms import current_platform

    if not (current_platform.is_cuda() if cuda is None else cuda):
        return ()
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)


def served_as_loaded(model: torch.nn.Module, cuda: bool | None = None) -> set[str]:
    """The names of the modules of ``model`` whose tensors vLLM serves as loaded (``cuda``:
    as it would on CUDA, or not; default this platform: the bench bakes a CUDA plan on CPU)."""
    methods = _as_loaded_methods(cuda)

    def processed(module: torch.nn.Module) -> bool:
        quant_method = getattr(module, "quant_method", None)
        return callable(getattr(module, "process_weights_after_loading", None)) or (
            quant_method is not None and type(quant_method) not in methods
        )

    return modules_as_loaded(model, processed)
