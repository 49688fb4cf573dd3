"""Which of a vLLM model's layers serve their weights exactly as the loaders wrote them: those a
version may replay straight into (:mod:`weightsync.receiver.replay`). Every other layer is
processed after loading (quantized, repacked for vLLM-CPU's GEMMs, its MoE kernel rebuilt,
weights derived from it as MLA attention derives its own from ``kv_b_proj``) and takes vLLM's
layerwise reload, which runs that processing again.
"""

from __future__ import annotations

import torch

from weightsync.receiver.name_resolver import aliases


def _as_loaded_methods() -> tuple[type, ...]:
    """The quantization methods whose ``process_weights_after_loading`` leaves the weights as
    they are on this platform: the unquantized linear and embedding ones on CUDA (on CPU they
    repack, on XPU they may transpose). Exact types: a subclass may process."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return ()
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)


def served_as_loaded(model: torch.nn.Module) -> set[str]:
    """The names of the modules of ``model`` whose tensors vLLM serves as loaded."""
    methods = _as_loaded_methods()
    processed: set[int] = set()
    for module in model.modules():
        if callable(getattr(module, "process_weights_after_loading", None)):
            # Attention layers process (and may derive from) what they hold.
            processed.update(id(m) for m in module.modules())
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None and type(quant_method) not in methods:
            processed.add(id(module))
    as_loaded = {
        name
        for name, module in model.named_modules(remove_duplicate=False)
        if id(module) not in processed
    }
    # A tied weight is as loaded only where every layer holding it is (vLLM-CPU repacks a tied
    # lm_head while the embedding may be plain).
    for live_name, others in aliases(model).items():
        if any(other.rpartition(".")[0] not in as_loaded for other in others):
            as_loaded.discard(live_name.rpartition(".")[0])
    return as_loaded
