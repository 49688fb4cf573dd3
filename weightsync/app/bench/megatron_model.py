"""A real megatron-core ``GPTModel`` of a bench :class:`~.models.ModelShape`, for the node case's
Megatron trainer (:mod:`.megatron_node`).

The local layer spec (no TransformerEngine), bf16 parameters built straight on the rank's
device with a no-op initializer (the bench fills them by HF name every version, so any init
is wasted work). Dense shapes are Qwen2 (q/k/v biases) or Qwen3 (q/k norms), MoE shapes
Qwen3-MoE (routed experts in every layer, each expert whole on one rank: expert TP=1, EP as
given). Requires megatron-core (the ``megatron`` extra).

On CPU (the tiny shapes, over gloo), megatron-core 0.16 still asks CUDA for the device of a
few buffers; :func:`apply_cpu_shims` answers "cpu" in the bench's own rank processes.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import torch

from weightsync.app.bench.models import ModelShape, hf_config_fields

TIMEOUT = timedelta(minutes=10)
"""Of the ranks' process group: building a 7B model's ranks is seconds, not minutes."""


def _no_init(_tensor: torch.Tensor) -> None:
    """Megatron's ``init_method``: leave the memory as allocated (the bench fills it)."""


def hf_config(shape: ModelShape) -> SimpleNamespace:
    """The HF config ``MegatronPublisher`` converts to, its fields as a transformers config
    holds them (no transformers needed on the GPU machine)."""
    model_type, fields = hf_config_fields(shape)
    return SimpleNamespace(model_type=model_type, **fields)


def transformer_config(shape: ModelShape, tp: int, ep: int, cuda: bool):
    """megatron's ``TransformerConfig`` of ``shape`` at TP ``tp`` (EP ``ep`` for MoE)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {}
    if shape.is_moe:
        moe = dict(
            num_moe_experts=shape.experts,
            moe_ffn_hidden_size=shape.moe_intermediate,
            moe_router_topk=min(2, shape.experts),
            moe_token_dispatcher_type="allgather",  # alltoall makes a CUDA stream
            moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none",
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
        )
    return TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_rows,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=not cuda,
        init_method=_no_init,
        output_layer_init_method=_no_init,
        **moe,
    )


def init_ranks(rank: int, world: int, rendezvous: str, tp: int, ep: int, cuda: bool) -> None:
    """Join the ranks' process group (NCCL on CUDA, gloo on CPU; ``rendezvous``: a file no
    rank created yet) and megatron's TP / DP (/ EP) groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not cuda:
        apply_cpu_shims()
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1 if ep > 1 else None,
    )
    if cuda:  # the GPU init path forks megatron's CUDA RNG states, even for a no-op init
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)


def close_ranks() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


def apply_cpu_shims() -> None:
    """megatron-core 0.16 on CPU: ``torch.cuda.current_device()`` names the device of the MoE
    router's buffers even with ``use_cpu_initialization``; answer "cpu" (rank processes only)."""
    torch.cuda.current_device = lambda: "cpu"


def build_model(shape: ModelShape, tp: int, ep: int, device: torch.device) -> torch.nn.Module:
    """This rank's ``GPTModel`` (PP=1) of ``shape``, bf16 on ``device``, after
    :func:`init_ranks`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = transformer_config(shape, tp, ep, device.type == "cuda")
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(
        config,
        spec,
        vocab_size=shape.vocab,
        max_sequence_length=4096,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    # The router is built on the CPU whatever the device; the rest is there already.
    return model.to(device=device, dtype=torch.bfloat16).eval()


def in_param_buffers(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` wrapped as trainers run it, megatron's ``DistributedDataParallel`` with the
    distributed optimizer's layout: every parameter a view into one contiguous buffer (one
    for the dense parameters, one for the experts), as a real trainer's shards are offered.
    Its gradient buffer (bf16) doubles the memory; no step runs."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=False)
    return DistributedDataParallel(model.config, ddp, model)
