"""Which of a vLLM model's layers serve their weights exactly as the loaders wrote them: those a
version may replay straight into (:mod:`weightsync.receiver.replay`). Every other layer is
processed after loading (quantized, repacked for vLLM-CPU's GEMMs, its MoE weights shuffled for
a backend's kernel, weights derived from it as MLA attention derives its own from
``kv_b_proj``) and takes vLLM's layerwise reload, which runs that processing again.

On CUDA that is the unquantized linear and embedding layers, the norms, and the fused MoE
experts of ``UnquantizedFusedMoEMethod`` where vLLM's oracle chose its Triton kernels
(:func:`_experts_as_loaded` says why exactly then).
"""

from __future__ import annotations

import torch

from weightsync.receiver.replay import modules_as_loaded

AS_LOADED_MOE_BACKENDS = frozenset({"TRITON", "BATCHED_TRITON"})
"""The ``UnquantizedMoeBackend`` members whose expert weights vLLM (>= 0.30) serves as loaded
on CUDA: ``convert_to_unquantized_kernel_format`` only makes them contiguous (they are) and
their experts (``TritonExperts``, ``BatchedTritonExperts``) process nothing. The others rewrite
them: FlashInfer CUTLASS swaps the gate and up halves, FlashInfer TRT-LLM pads and permutes
into its block layout, AITER shuffles, MoonEP regroups; CPU packs, XPU transposes, TPU and
out-of-tree platforms process inside."""


def _as_loaded_methods(cuda: bool) -> tuple[type, ...]:
    """The linear and embedding methods whose ``process_weights_after_loading`` leaves the
    weights as they are on CUDA (on CPU they repack, on XPU they may transpose). Exact types:
    a subclass may process."""
    if not cuda:
        return ()
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)


def served_as_loaded(model: torch.nn.Module, cuda: bool | None = None) -> set[str]:
    """The names of the modules of ``model`` whose tensors vLLM serves as loaded.

    ``cuda`` None: on this platform, judged from each layer as built (its chosen MoE backend).
    True on another platform (the bench bakes a CUDA plan on vllm-cpu): as vLLM would on a
    CUDA GPU where its oracle picks Triton for unquantized MoE, as it does on Hopper (it ranks
    FlashInfer after Triton there); the layer's config must not name another backend.
    """
    from vllm.platforms import current_platform

    here = current_platform.is_cuda()
    on_cuda = here if cuda is None else cuda
    methods = _as_loaded_methods(on_cuda)

    def processed(module: torch.nn.Module) -> bool:
        if callable(getattr(module, "process_weights_after_loading", None)):
            return True
        quant_method = getattr(module, "quant_method", None)
        if quant_method is None or type(quant_method) in methods:
            return False
        return not (on_cuda and _experts_as_loaded(module, quant_method, live=on_cuda == here))

    return modules_as_loaded(model, processed)


def _experts_as_loaded(layer: torch.nn.Module, method: object, *, live: bool) -> bool:
    """Whether vLLM serves this fused-MoE layer's ``w13``/``w2`` weights and biases on CUDA as
    loaded. Unsure (an attribute this vLLM lacks) is no.

    ``UnquantizedFusedMoEMethod.process_weights_after_loading`` on CUDA with the Triton
    backends pads only on ROCm (``VLLM_ROCM_MOE_PADDING``), converts with ``.contiguous()``,
    rebinds the same storage (later calls copy into it) and calls the experts' own hook, a
    no-op for Triton's. Also refused: EPLB (it moves experts between slots at run time, so a
    bake's slots go stale), padded sizes (DeepEP and others round the hidden size up; the
    loaders leave the padding alone), and any other quantization method (LoRA wraps this one).

    ``live`` False: the layer was built on another platform; its backend is the one CUDA would
    pick for its config (:func:`served_as_loaded`).
    """
    from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod

    config = getattr(layer, "moe_config", None)
    parallel = getattr(config, "moe_parallel_config", None)
    if type(method) is not UnquantizedFusedMoEMethod or parallel is None:
        return False
    if getattr(parallel, "enable_eplb", True) or _padded(config):
        return False
    if not live:
        return _cuda_backend(config) in AS_LOADED_MOE_BACKENDS
    backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
    kernel = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    return (
        backend in AS_LOADED_MOE_BACKENDS
        and (kernel is None or not _processes(kernel))
        and all(p.is_contiguous() for p in layer.parameters(recurse=False))
    )


def _padded(config: object) -> bool:
    """Whether the layer's expert weights are larger than the checkpoint's (or unsure)."""
    sizes = [
        getattr(config, name, None)
        for name in (
            "hidden_dim",
            "hidden_dim_unpadded",
            "intermediate_size_per_partition",
            "intermediate_size_per_partition_unpadded",
        )
    ]
    return None in sizes or sizes[0] != sizes[1] or sizes[2] != sizes[3]


def _processes(experts: object) -> bool:
    """Whether a modular kernel's experts override the base class's no-op
    ``process_weights_after_loading`` (vLLM-CPU's pack the weights)."""
    hook = getattr(type(experts), "process_weights_after_loading", None)
    return hook is not None and not hook.__module__.endswith("fused_moe.modular_kernel")


def _cuda_backend(config: object) -> str | None:
    """The backend vLLM's oracle picks on a Hopper GPU for this layer's config: the one the
    config names, else Triton; None (unsure) with LoRA (FlashInfer's TRT-LLM LoRA experts are
    tried first) or MoonEP kernels."""
    parallel = config.moe_parallel_config
    if getattr(config, "is_lora_enabled", True) or getattr(parallel, "use_moonep_kernels", True):
        return None
    named = getattr(config, "moe_backend", None)
    if named in ("auto", "humming"):  # humming is for quantized layers only
        return "TRITON"
    return named.upper() if isinstance(named, str) else None
