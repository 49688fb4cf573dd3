"""Which of an SGLang model's layers serve their weights exactly as the loaders wrote them: those
a version may replay straight into (:mod:`weightsync.receiver.replay`). The others are
processed after loading (quantized; packed for the CPU's AMX kernels; fused experts shuffled
or converted for a backend) and take SGLang's ``load_weights``. The model's own
``post_load_weights`` (DeepSeek's absorbed MLA matrices) runs at every commit either way.
"""

from __future__ import annotations

import torch

from weightsync.receiver.replay import modules_as_loaded


def served_as_loaded(model: torch.nn.Module) -> set[str]:
    """The names of the modules of ``model`` whose tensors SGLang serves as loaded: plain
    layers, and unquantized linear and embedding layers not packed for AMX (exact types: a
    subclass may process)."""
    from sglang.srt.layers.quantization.unquant import (
        UnquantizedEmbeddingMethod,
        UnquantizedLinearMethod,
    )

    methods = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)

    def processed(module: torch.nn.Module) -> bool:
        quant_method = getattr(module, "quant_method", None)
        amx = bool(getattr(module, "use_intel_amx_backend", False))
        return amx or (quant_method is not None and type(quant_method) not in methods)

    return modules_as_loaded(model, processed)
