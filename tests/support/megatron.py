"""Test-only helpers for real megatron-core models on CPU over gloo.

Everything here stays out of the library: the CPU shims megatron-core 0.16.1 needs for a
forward pass, tiny model cases with their matching transformers configs, a deterministic fill
that follows megatron's own TP split, a gloo launcher (file:// rendezvous, no ports) and the
rank workers it runs (collecting shards, publishing through ``MegatronPublisher``).

CPU shims (megatron-core 0.16.1 assumes CUDA in a few places even with
``use_cpu_initialization=True``):

- ``torch.cuda.current_device()`` is used as a device for router buffers and weights: -> "cpu".
- ``CudaRNGStatesTracker.fork()`` swaps CUDA RNG states around attention dropout: a no-op
  (dropout is 0 in these tests).
- ``moe_utils.te_general_gemm`` is referenced but never defined without TransformerEngine.
- The local attention builds its default causal mask on "cuda": pass an explicit mask.
- ``MoEAlltoAllTokenDispatcher`` creates a CUDA stream: use the "allgather" dispatcher.
- Without TransformerEngine, megatron-core puts MagicMocks where TE's classes would be, and
  MLA's ``isinstance(linear_proj, TELinear)`` raises on them: MLA's ``HAVE_TE`` -> False.
- With tied embeddings and PP > 1, ``setup_embeddings_and_output_layer`` moves the last
  stage's embedding copy with ``.cuda()`` before all-reducing it: ``Tensor.cuda`` -> identity.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import re
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch

from tests.support.models import digests, holder_module, tiny_config
from tests.support.processes import Outcome, Reporter, Reports

SEQ = 12
ROUTED_SCALING = 2.5
INPUT_SEED = 1234


def apply_cpu_shims() -> None:
    """Patch megatron-core for CPU (call in worker processes only)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    import megatron.core.transformer.multi_latent_attention as mla

    mla.HAVE_TE = False


# --- model cases -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelCase:
    """A tiny Megatron GPT model and the HF model it converts to."""

    name: str
    model_type: str
    num_layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    ffn: int = 256
    hf_vocab: int = 250
    padded_vocab: int = 256
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    gated: bool = True
    layernorm: bool = False
    linear_bias: bool = False
    experts: int = 0
    moe_ffn: int = 64
    topk: int = 2
    moe_layers: tuple[int, ...] | None = None
    """Which layers are MoE (None: all, when ``experts``)."""
    shared_ffn: int = 0
    pre_softmax: bool = False
    expert_bias: bool = False
    grouped_gemm: bool = False
    mtp_layers: int = 0
    mla: bool = False
    """Multi-latent attention (DeepSeek-V3): ``head_dim`` is ``qk_nope_head_dim``."""
    q_lora_rank: int | None = 48
    kv_lora_rank: int = 64
    qk_rope_head_dim: int = 16
    v_head_dim: int = 24

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and (self.moe_layers is None or layer in self.moe_layers)


DENSE_CASES = (
    ModelCase("llama_gqa", "llama"),
    ModelCase("llama_mqa_tied", "llama", kv_heads=1, tied=True),
    ModelCase("qwen2_bias", "qwen2", qkv_bias=True),
    ModelCase("qwen3_qknorm", "qwen3", head_dim=64, qk_norm=True, tied=True),
    ModelCase(
        "starcoder2_nongated",
        "starcoder2",
        gated=False,
        layernorm=True,
        linear_bias=True,
        qkv_bias=True,
        tied=True,
    ),
)
MOE_CASES = (
    ModelCase("qwen3_moe", "qwen3_moe", qk_norm=True, experts=4, moe_layers=(1, 2, 3)),
    ModelCase("mixtral", "mixtral", experts=4, ffn=64),
    ModelCase(
        "qwen2_moe_shared", "qwen2_moe", qkv_bias=True, experts=4, shared_ffn=96, pre_softmax=True
    ),
    ModelCase(
        "glm4_moe_expert_bias",
        "glm4_moe",
        qkv_bias=True,
        experts=4,
        moe_layers=(1, 2, 3),
        shared_ffn=64,
        expert_bias=True,
        mtp_layers=1,
    ),
)
CASES = {c.name: c for c in DENSE_CASES + MOE_CASES}
FP8_CASE = ModelCase(
    "llama_fp8", "llama", num_layers=2, hidden=192, heads=4, kv_heads=2, head_dim=128, ffn=256
)
"""Block FP8 from the ranks (tests/integration/test_megatron_fp8.py): at TP=2 every split
(query groups of 2 x 128 rows, 128 key / value rows, FFN halves of 128, row-parallel halves
of 128 columns) is a multiple of the 128 x 128 block; hidden 192 leaves edge blocks."""
_DEEPSEEK = dict(
    mla=True,
    kv_heads=4,
    experts=4,
    moe_layers=(1, 2, 3),
    shared_ffn=64,
    expert_bias=True,
    mtp_layers=1,
)
MLA_CASES = (
    ModelCase("deepseek_v3", "deepseek_v3", **_DEEPSEEK),
    ModelCase("deepseek_v3_no_q_lora", "deepseek_v3", **_DEEPSEEK, q_lora_rank=None),
)
"""DeepSeek-V3 (tests/integration/test_megatron_deepseek.py): MLA, the first layer dense, MoE
with a shared expert and the routing bias, one MTP layer."""
CASE_BY_NAME = {**CASES, **{c.name: c for c in MLA_CASES}, FP8_CASE.name: FP8_CASE}


def hf_config(case: ModelCase):
    """The transformers config of ``case`` (built locally, no hub)."""
    if case.mla:
        return _deepseek_v3_config(case)
    common = dict(
        vocab_size=case.hf_vocab,
        hidden_size=case.hidden,
        num_hidden_layers=case.num_layers,
        num_attention_heads=case.heads,
        num_key_value_heads=case.kv_heads,
        intermediate_size=case.ffn,
        max_position_embeddings=64,
        tie_word_embeddings=case.tied,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return tiny_config(case.model_type, **common, **_type_fields(case))


def _type_fields(case: ModelCase) -> dict:
    """The config fields of ``case`` that depend on its model type."""
    norm = dict(rms_norm_eps=1e-6)
    t = case.model_type
    if t in ("llama", "qwen3"):
        return dict(**norm, head_dim=case.head_dim)
    if t == "qwen2":
        return norm
    if t == "starcoder2":
        return dict(
            norm_epsilon=1e-6,
            use_bias=True,
            hidden_act="gelu_pytorch_tanh",
            bos_token_id=None,
            eos_token_id=None,
            residual_dropout=0.0,
            embedding_dropout=0.0,
            attention_dropout=0.0,
        )
    moe = dict(**norm, num_experts_per_tok=case.topk, moe_intermediate_size=case.moe_ffn)
    mlp_only = [i for i in range(case.num_layers) if not case.is_moe(i)]
    if t == "qwen3_moe":
        return dict(
            **moe,
            head_dim=case.head_dim,
            num_experts=case.experts,
            norm_topk_prob=True,
            mlp_only_layers=mlp_only,
        )
    if t == "qwen2_moe":
        return dict(
            **moe,
            num_experts=case.experts,
            shared_expert_intermediate_size=case.shared_ffn,
            norm_topk_prob=False,
            mlp_only_layers=mlp_only,
        )
    if t == "glm4_moe":
        return dict(
            **moe,
            head_dim=case.head_dim,
            n_routed_experts=case.experts,
            n_shared_experts=case.shared_ffn // case.moe_ffn,
            first_k_dense_replace=min(case.moe_layers),
            attention_bias=case.qkv_bias,
            norm_topk_prob=True,
            routed_scaling_factor=ROUTED_SCALING,
            n_group=1,
            topk_group=1,
            partial_rotary_factor=1.0,
            use_qk_norm=case.qk_norm,
            num_nextn_predict_layers=case.mtp_layers,
        )
    if t == "mixtral":
        return dict(
            **norm,
            num_experts_per_tok=case.topk,
            num_local_experts=case.experts,
            head_dim=case.head_dim,
        )
    raise ValueError(t)


def _deepseek_v3_config(case: ModelCase):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=case.hf_vocab,
        hidden_size=case.hidden,
        num_hidden_layers=case.num_layers,
        num_attention_heads=case.heads,
        num_key_value_heads=case.heads,
        intermediate_size=case.ffn,
        moe_intermediate_size=case.moe_ffn,
        n_routed_experts=case.experts,
        n_shared_experts=case.shared_ffn // case.moe_ffn,
        num_experts_per_tok=case.topk,
        first_k_dense_replace=min(case.moe_layers),
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=ROUTED_SCALING,
        q_lora_rank=case.q_lora_rank,
        kv_lora_rank=case.kv_lora_rank,
        qk_nope_head_dim=case.head_dim,
        qk_rope_head_dim=case.qk_rope_head_dim,
        v_head_dim=case.v_head_dim,
        max_position_embeddings=64,
        tie_word_embeddings=case.tied,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_nextn_predict_layers=case.mtp_layers,
    )


def _mla_config(kwargs: dict, case: ModelCase):
    """megatron's ``MLATransformerConfig`` for ``case``: plain RoPE on the rope dims (HF
    ``rope_interleave``: megatron de-interleaves them for MLA), q / kv norms built."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        **{
            **kwargs,
            "kv_channels": case.v_head_dim,  # what the local core attention's output width reads
            "qk_layernorm": True,
        },
        q_lora_rank=case.q_lora_rank,
        kv_lora_rank=case.kv_lora_rank,
        qk_head_dim=case.head_dim,
        qk_pos_emb_head_dim=case.qk_rope_head_dim,
        v_head_dim=case.v_head_dim,
        rope_type="rope",
        rotary_base=10000,
    )


def _local_mla_core_attention():
    """megatron's local ``DotProductAttention`` for MLA (the local spec's MLA path passes
    ``k_channels`` / ``v_channels``, which it does not take; its math already handles a value
    head narrower than the query head once ``kv_channels`` is the value width)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return MLADotProductAttention


def transformer_config(case: ModelCase, sizes: dict):
    """The megatron ``TransformerConfig`` of ``case`` for parallel ``sizes``."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=case.num_layers,
        hidden_size=case.hidden,
        num_attention_heads=case.heads,
        num_query_groups=case.kv_heads,
        kv_channels=case.head_dim,
        ffn_hidden_size=case.ffn,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=1e-6,
        normalization="LayerNorm" if case.layernorm else "RMSNorm",
        gated_linear_unit=case.gated,
        activation_func=F.silu if case.gated else partial(F.gelu, approximate="tanh"),
        add_bias_linear=case.linear_bias,
        add_qkv_bias=case.qkv_bias,
        qk_layernorm=case.qk_norm,
        tensor_model_parallel_size=sizes["tp"],
        pipeline_model_parallel_size=sizes["pp"],
        virtual_pipeline_model_parallel_size=sizes.get("vpp"),
        expert_model_parallel_size=sizes.get("ep", 1),
        expert_tensor_parallel_size=sizes.get("etp"),
        sequence_parallel=False,
        pipeline_dtype=torch.float32,
        num_layers_in_first_pipeline_stage=sizes.get("first_stage_layers"),
        num_layers_in_last_pipeline_stage=sizes.get("last_stage_layers"),
    )
    if case.experts:
        kwargs.update(
            num_moe_experts=case.experts,
            moe_ffn_hidden_size=case.moe_ffn,
            moe_router_topk=case.topk,
            moe_token_dispatcher_type="allgather",
            moe_router_pre_softmax=case.pre_softmax,
            moe_layer_freq=[1 if case.is_moe(i) else 0 for i in range(case.num_layers)],
            moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none",
            moe_grouped_gemm=case.grouped_gemm,
            moe_router_enable_expert_bias=case.expert_bias,
        )
        if case.expert_bias:  # GLM-4.5 / DeepSeek-V3 style routing
            kwargs.update(
                moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=ROUTED_SCALING
            )
        if case.shared_ffn:
            kwargs.update(
                moe_shared_expert_intermediate_size=case.shared_ffn,
                moe_shared_expert_gate=case.model_type == "qwen2_moe",
            )
    if case.mtp_layers:
        kwargs.update(mtp_num_layers=case.mtp_layers)
    if case.mla:
        return _mla_config(kwargs, case)
    return TransformerConfig(**kwargs)


def build_chunks(case: ModelCase, sizes: dict) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), eval mode."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )

    config = transformer_config(case, sizes)
    vpp = sizes.get("vpp")
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        spec = get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=False,
            normalization="LayerNorm" if case.layernorm else "RMSNorm",
            vp_stage=vp_stage,
        )
        if case.mla:
            for layer_spec in spec.layer_specs:
                attention = layer_spec.submodules.self_attention.submodules
                attention.core_attention = _local_mla_core_attention()
        mtp = None
        if case.mtp_layers:
            mtp = get_gpt_mtp_block_spec(
                config, spec, use_transformer_engine=False, vp_stage=vp_stage
            )
        model = GPTModel(
            config,
            spec,
            vocab_size=case.padded_vocab,
            max_sequence_length=64,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=False,
            share_embeddings_and_output_weights=case.tied,
            position_embedding_type="rope",
            rotary_base=10000,
            vp_stage=vp_stage,
            mtp_block_spec=mtp,
        )
        chunks.append(model.eval())
    return chunks


# --- deterministic fill ----------------------------------------------------------------------

_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def global_name(model: torch.nn.Module, name: str, ep_rank: int, local_experts: int) -> str:
    """``name`` with the chunk-local layer and local expert made global."""
    match = _LAYER.match(name)
    if match:
        layer = model.decoder.layers[int(match.group(2))].layer_number - 1
        name = f"{match.group(1)}{layer}{match.group(3)}"
    return _EXPERT.sub(
        lambda m: f".local_experts.{ep_rank * local_experts + int(m.group(1))}.", name
    )


@torch.no_grad()
def fill_by_global_name(chunks: list[torch.nn.Module], case: ModelCase) -> None:
    """Give every parameter (and the expert bias) values seeded by its *global* name.

    The master tensor is generated whole and this rank's part is cut exactly the way
    megatron's ``_initialize_affine_weight_cpu`` cuts it (``partition_dim``,
    ``partition_stride``), so ranks of any layout hold slices of the same global weights,
    also where layers / experts are built on different ranks in a different RNG order.
    """
    from megatron.core import parallel_state as ps

    ep_rank, ep = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    local_experts = case.experts // ep if case.experts else 0
    for model in chunks:
        named = list(model.named_parameters()) + [
            (n, b) for n, b in model.named_buffers() if n.endswith("expert_bias")
        ]
        for name, param in named:
            gname = global_name(model, name, ep_rank, local_experts)
            is_expert = ".experts." in name
            if is_expert:
                rank = ps.get_expert_tensor_parallel_rank()
                size = ps.get_expert_tensor_parallel_world_size()
            else:
                rank = ps.get_tensor_model_parallel_rank()
                size = ps.get_tensor_model_parallel_world_size()
            seed = int.from_bytes(hashlib.sha256(gname.encode()).digest()[:8], "little") >> 1
            gen = torch.Generator().manual_seed(seed)
            if not getattr(param, "tensor_model_parallel", False):
                param.copy_(
                    torch.randn(param.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0)
                )
                continue
            dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
            master_shape = list(param.shape)
            master_shape[dim] *= size
            master = torch.randn(master_shape, generator=gen) * 0.05
            per = param.shape[dim] // stride
            parts = torch.split(master, per, dim=dim)[rank::size]
            param.copy_(torch.cat(parts, dim=dim))


# --- forward ---------------------------------------------------------------------------------


def input_ids(case: ModelCase) -> torch.Tensor:
    gen = torch.Generator().manual_seed(INPUT_SEED)
    return torch.randint(0, case.hf_vocab, (2, SEQ), generator=gen)


@torch.no_grad()
def megatron_logits(model: torch.nn.Module, case: ModelCase) -> torch.Tensor:
    """Float32 logits ``[batch, seq, hf_vocab]`` of a full (PP=1) model chunk."""
    ids = input_ids(case)
    pos = torch.arange(SEQ).expand_as(ids)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    # The MTP head needs labels and transformers has no MTP: compare the main head only.
    mtp = model.mtp_process, model.config.mtp_num_layers
    model.mtp_process, model.config.mtp_num_layers = False, None
    try:
        logits = model(ids, pos, attention_mask=mask)
    finally:
        model.mtp_process, model.config.mtp_num_layers = mtp
    return logits[..., : case.hf_vocab].float().clone()


def hf_model(case: ModelCase, state: dict[str, torch.Tensor], directory: Path):
    """A transformers model loaded with ``from_pretrained`` from ``state`` saved as a checkpoint.

    Going through a safetensors checkpoint means the converted names are read exactly as an
    engine or ``from_pretrained`` reads HF checkpoints (transformers 5 fuses per-expert
    tensors on load). Returns the model and transformers' loading info (missing / unexpected
    keys).
    """
    import transformers
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config(case)
    config.save_pretrained(directory)
    save_file(
        {k: v.clone().contiguous() for k, v in state.items()}, directory / "model.safetensors"
    )
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


# --- gloo launch -----------------------------------------------------------------------------


def _entry(rank: int, world: int, init_file: str, sizes: dict, fn, args, out_dir: str) -> None:
    import torch.distributed as dist

    try:
        apply_cpu_shims()
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),  # a stuck collective fails the test, not CI
        )
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(
            tensor_model_parallel_size=sizes["tp"],
            pipeline_model_parallel_size=sizes["pp"],
            virtual_pipeline_model_parallel_size=sizes.get("vpp"),
            expert_model_parallel_size=sizes.get("ep", 1),
            expert_tensor_parallel_size=sizes.get("etp"),
            distributed_timeout_minutes=2,
        )
        result = fn(rank, sizes, *args)
        if result is not None:
            torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def launch(tmp_path: Path, sizes: dict, fn, *args) -> dict[int, object]:
    """Run ``fn(rank, sizes, *args)`` on ``world`` gloo ranks; returns what each rank returned.

    ``sizes``: ``tp``, ``pp`` and optionally ``vpp``, ``ep``, ``etp``, ``dp``. The world is
    ``dp`` times the smallest that fits both the dense (tp x pp) and the expert (etp x ep x pp)
    layouts; EP is carved out of data parallelism, as in megatron.
    """
    from tests.support import children

    expert = sizes.get("ep", 1) * (sizes.get("etp") or sizes["tp"])
    world = sizes["pp"] * math.lcm(sizes["tp"], expert) * sizes.get("dp", 1)
    out_dir = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
    out_dir.mkdir()
    init_file = str(out_dir / "rendezvous")
    try:
        children.start_ranks(_entry, (world, init_file, sizes, fn, args, str(out_dir)), world)
    except Exception as e:
        errors = "\n".join(p.read_text() for p in sorted(out_dir.glob("*.error")))
        raise AssertionError(f"gloo workers failed ({sizes}):\n{errors}") from e
    return {
        int(p.stem.removeprefix("rank")): torch.load(p, weights_only=False)
        for p in sorted(out_dir.glob("rank*.pt"))
    }


def collect_worker(rank: int, sizes: dict, case_names: list[str], fill: bool, logits: bool):
    """Build each case, collect and gather its shards (rank 0 returns them), optional logits."""
    import torch.distributed as dist

    from weightsync.sender.megatron import collect_shards, gather_local_shards

    out = {}
    for name in case_names:
        case = CASE_BY_NAME[name]
        torch.manual_seed(0)
        chunks = build_chunks(case, sizes)
        if fill:
            fill_by_global_name(chunks, case)
        states = gather_local_shards(collect_shards(chunks))
        entry = {"states": states}
        if logits and sizes["pp"] == 1:
            entry["logits"] = megatron_logits(chunks[0], case)
        dist.barrier()
        if rank == 0:
            out[name] = entry
    return out if rank == 0 else None


def grouped_mlp_metadata_worker(rank: int, sizes: dict, case_name: str):
    """Names, shapes and partition dims of a real legacy ``GroupedMLP`` (``moe_grouped_gemm``).

    grouped_gemm is not installed on CPU; the module only checks for it, so the check is
    patched out to build it (it cannot run forward here).
    """
    from dataclasses import replace

    import megatron.core.transformer.moe.grouped_gemm_util as gg

    from weightsync.sender.megatron import collect_shards

    gg.assert_grouped_gemm_is_available = lambda: None
    case = replace(CASES[case_name], grouped_gemm=True)
    local = collect_shards(build_chunks(case, sizes))
    return sorted((s.name, s.shape, s.partition_dim) for s in local.shards if ".experts." in s.name)


# --- publishing ------------------------------------------------------------------------------

VERSIONS = 2
"""How many versions ``publish_worker`` publishes."""


@torch.no_grad()
def stand_in_step(chunks: list[torch.nn.Module]) -> None:
    """A stand-in optimizer step, the same on every replica."""
    for chunk in chunks:
        for i, p in enumerate(chunk.parameters()):
            if i % 2:
                p.mul_(0.5).add_(0.25)
            else:  # as frameworks that offload and reload weights do: new memory
                p.data = p.data.mul(0.5).add(0.25)


def publish_worker(
    rank: int,
    sizes: dict,
    case_name: str,
    address: str | dict[str, str],
    cuda: bool = False,
    host_ids: list[str] | None = None,
    versions: int = VERSIONS,
    export_mtp: bool = True,
    direct: bool = False,
    fp8: bool = False,
):
    """Build the model, publish ``versions`` versions (weights change between them); rank 0
    returns each version's gathered shards. ``direct``: the publisher's ``direct``; ``fp8``:
    its ``fp8`` (a default ``BlockFp8``).

    ``cuda``: move rank r's chunks to ``cuda:r`` after building, so shards travel by CUDA IPC.
    ``host_ids``: rank r claims host ``host_ids[r]`` (``address``: each host's sender).
    """
    from weightsync.fp8 import BlockFp8
    from weightsync.sender.megatron import MegatronPublisher, collect_shards, gather_local_shards

    case = CASE_BY_NAME[case_name]
    torch.manual_seed(0)
    chunks = build_chunks(case, sizes)
    fill_by_global_name(chunks, case)
    if cuda:
        chunks = [chunk.to(f"cuda:{rank}") for chunk in chunks]
    host_id = host_ids[rank] if host_ids else None
    publisher = MegatronPublisher(
        chunks,
        hf_config(case),
        address,
        host_id=host_id,
        export_mtp=export_mtp,
        direct=direct,
        fp8=BlockFp8() if fp8 else None,
    )
    states = []
    for version in range(1, versions + 1):
        if version > 1:
            stand_in_step(chunks)
        publisher.publish(version, wait=True, timeout_s=120)
        states.append(gather_local_shards(collect_shards(chunks)))
    publisher.close()
    return states if rank == 0 else None


def offer_worker(rank: int, sizes: dict, case_name: str, address: str, replicas: bool = True):
    """Build the model and return what this rank would offer the sender: its manifest's
    specs and a ``BeginVersion`` of its regions' pieces (as ``publish`` describes them; the
    sources numbered by storage here, nothing exported); ``replicas``: ``offer_replicas``."""
    from weightsync.sender.megatron import MegatronPublisher
    from weightsync.v1 import weightsync_pb2 as pb
    from weightsync.wire import regions_to_pb

    case = CASE_BY_NAME[case_name]
    torch.manual_seed(0)
    chunks = build_chunks(case, sizes)
    publisher = MegatronPublisher(
        chunks, hf_config(case), address, direct=True, offer_replicas=replicas
    )
    storages: dict[int, int] = {}

    def locate(tensor: torch.Tensor) -> tuple[int, int]:
        index = storages.setdefault(tensor.untyped_storage().data_ptr(), len(storages))
        return index, tensor.storage_offset() * tensor.element_size()

    begin = pb.BeginVersion(allow_direct=True)
    begin.pieces.extend(regions_to_pb(publisher.regions(), locate))
    begin.sources.extend(pb.BufferHandle(buffer_id=f"{rank}-{i}") for i in range(len(storages)))
    specs = publisher.manifest.tensors
    publisher.close()
    return specs, begin.SerializeToString()


# --- converted versions for engines without megatron-core in their venv -------------------------


def versions_worker(rank: int, sizes: dict, case_name: str, versions: int):
    """Build and fill the model, then per version (``stand_in_step`` between them) gather its
    shards; rank 0 returns them."""
    from weightsync.sender.megatron import collect_shards, gather_local_shards

    case = CASE_BY_NAME[case_name]
    torch.manual_seed(0)
    chunks = build_chunks(case, sizes)
    fill_by_global_name(chunks, case)
    states = []
    for version in range(1, versions + 1):
        if version > 1:
            stand_in_step(chunks)
        states.append(gather_local_shards(collect_shards(chunks)))
    return states if rank == 0 else None


def save_converted_versions(case_name: str, directory: str, tp: int = 2, versions: int = 2) -> None:
    """Convert ``versions`` versions of ``case_name`` trained at TP=``tp`` (the sender's code
    path: plan, buckets, packing) and save version v's HF tensors as
    ``{directory}/v{v}.safetensors``. Run in the main venv; the SGLang venv has no megatron::

        python -c "from tests.support.megatron import save_converted_versions as s; s(...)"
    """
    from safetensors.torch import save_file

    from weightsync.sender.megatron import convert_megatron_to_hf

    out = Path(directory)
    config = hf_config(CASE_BY_NAME[case_name])
    states = launch(out, {"tp": tp, "pp": 1}, versions_worker, case_name, versions)[0]
    for version, state in enumerate(states, start=1):
        hf = convert_megatron_to_hf(state, config)
        save_file({k: v.contiguous() for k, v in hf.items()}, out / f"v{version}.safetensors")


@contextlib.contextmanager
def held_versions(receiver, model: torch.nn.Module, versions: int, timeout_s: float = 300):
    """Apply ``versions`` versions on a thread while the body publishes them; yields the list
    of ``model``'s state dicts after each (copies), complete once the block ends.

    Raises:
        AssertionError: the receiver failed, with its errors.
    """
    held: list[dict[str, torch.Tensor]] = []
    errors: list[Exception] = []

    def receive() -> None:
        try:
            for _ in range(versions):
                receiver.sync(timeout=timeout_s)
                held.append({k: v.clone() for k, v in model.state_dict().items()})
        except Exception as e:  # reported by the assertion below
            errors.append(e)

    thread = threading.Thread(target=receive)
    thread.start()
    yield held
    thread.join(timeout_s)
    assert not errors, errors


# --- receivers on other hosts, each in its own process ------------------------------------------


def receiving_model(case: ModelCase) -> torch.nn.Module:
    """What a receiver of ``case``'s HF tensors holds: the transformers model, or for an MoE
    case a holder of the per-expert checkpoint names (transformers fuses experts in the
    module)."""
    import transformers

    from weightsync.sender.megatron import hf_manifest

    config = hf_config(case)
    if case.experts:
        return holder_module({s.name: torch.zeros(s.shape) for s in hf_manifest(config, "float32")})
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


class _LostSender(logging.Handler):
    """Reports each sender a receiver's connection lost (the warning it logs once the
    version in flight is bound to fail on it)."""

    def __init__(self, out: Reporter, rid: str) -> None:
        super().__init__(logging.WARNING)
        self.out, self.rid = out, rid

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if " lost the sender at " in message:
            self.out.put(Outcome(self.rid, "lost", 0, {}, message))


def _receiver_main(addresses: list[str], rid: str, case_name: str, host: str, reports: str):
    os.environ["WEIGHTSYNC_HOST_ID"] = host  # before the hello, which names the host
    from weightsync.errors import WeightSyncError
    from weightsync.receiver import TorchReceiver

    out = Reporter(reports)
    logging.getLogger("weightsync.receiver").addHandler(_LostSender(out, rid))
    model = receiving_model(CASE_BY_NAME[case_name])
    receiver = TorchReceiver(model, addresses, receiver_id=rid)
    begin, began = receiver.target.begin, [0]

    def report_begin(manifest) -> None:
        began[0] = manifest.version
        out.put(Outcome(rid, "began", manifest.version, {}, ""))
        begin(manifest)

    receiver.target.begin = report_begin
    out.put(Outcome(rid, "ready", 0, {}, ""))
    while True:
        try:
            version = receiver.sync()
            out.put(Outcome(rid, "applied", version, digests(model), ""))
        except WeightSyncError as e:
            out.put(Outcome(rid, type(e).__name__, began[0], digests(model), str(e)))


def start_receiver(addresses: list[str], rid: str, case_name: str, host: str, out: Reports):
    """A receiver process on host ``host`` (``WEIGHTSYNC_HOST_ID``) holding
    ``receiving_model`` of ``case_name``, registered with every sender of ``addresses``, that
    syncs until it is ended. Reports to ``out``: ``ready`` once
    registered, ``began`` (the version) once a version's parts are joined and about to be
    written, ``lost`` (the message) when it loses a sender, and after each sync ``applied``
    or the error's type name (with the version it began), with the model's ``digests``."""
    from tests.support import children

    proc = children.process(
        _receiver_main, (addresses, rid, case_name, host, out.path), daemon=True
    )
    proc.start()
    return proc
