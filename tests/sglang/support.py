"""Build SGLang's real model classes on CPU, make HF checkpoint tensors, and drive a target
the way the receiver core does (buckets of views into one reused buffer)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable

import torch

from tests.sglang.compat import install_cpu_shims
from weightsync.buckets import ChunkAssembler, TensorSpec, pack_entry, plan_buckets, unpack_bucket
from weightsync.manifest import LoraAdapterSpec, VersionManifest

_initialized = False


def init_sglang() -> None:
    """A world-size-1 gloo group and SGLang's published topology; SGLang layers need both."""
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
    store = os.path.join(tempfile.mkdtemp(prefix="ws-sgl-"), "rendezvous")
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"file://{store}",
    )
    # What sglang.test.test_utils.publish_build_topology does (that module imports datasets).
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1),
            role="test", ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
    initialize_moe_config()
    _initialized = True


def _common(**extra: object) -> dict:
    return dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **extra)


def build(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(sglang_model, hf_model)`` for a tiny float32 config of ``arch``."""
    init_sglang()
    import transformers

    if arch == "qwen2":
        from sglang.srt.models.qwen2 import Qwen2ForCausalLM as Sgl

        config = transformers.Qwen2Config(**_common())
        hf_cls = transformers.Qwen2ForCausalLM
    elif arch == "llama":
        from sglang.srt.models.llama import LlamaForCausalLM as Sgl

        config = transformers.LlamaConfig(**_common())
        hf_cls = transformers.LlamaForCausalLM
    elif arch == "qwen3_moe":
        from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM as Sgl

        config = transformers.Qwen3MoeConfig(
            **_common(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, head_dim=32)
        )
        hf_cls = transformers.Qwen3MoeForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}")
    config.dtype = torch.float32
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
                    specs.append(TensorSpec(f"{head}experts.{e}.{which}.weight", "float32",
                                            (rows // 2, cols)))
        elif leaf == "down_proj":
            num_experts, rows, cols = t.shape
            specs.extend(TensorSpec(f"{head}experts.{e}.down_proj.weight", "float32", (rows, cols))
                         for e in range(num_experts))
        else:
            specs.append(TensorSpec.of(name, t))
    return specs


def random_tensors(specs: Iterable[TensorSpec], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=gen, dtype=s.torch_dtype) for s in specs}


_PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


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


def drive(target, manifest: VersionManifest, tensors: dict[str, torch.Tensor],
          bucket_size_bytes: int) -> int:
    """validate -> begin -> load per bucket -> commit, as the receiver core does; returns the
    number of load calls. Every bucket is packed into ONE reused buffer, which is scribbled
    over after each load, so a target keeping views instead of copies is caught."""
    target.validate(manifest)
    target.begin(manifest)
    plan = plan_buckets(manifest.tensors, bucket_size_bytes)
    buffer = torch.empty(bucket_size_bytes, dtype=torch.uint8)
    assembler = ChunkAssembler()
    for bucket in plan.buckets:
        for entry in bucket.entries:
            pack_entry(buffer, entry, tensors[entry.name])
        target.load(list(unpack_bucket(buffer, bucket, assembler)))
        buffer.fill_(0xFF)  # the next bucket reuses the buffer
    target.commit(manifest)
    return len(plan.buckets)


def manifest_for(version: int, tensors: dict[str, torch.Tensor],
                 lora: LoraAdapterSpec | None = None) -> VersionManifest:
    return VersionManifest(version, tuple(TensorSpec.of(n, t) for n, t in tensors.items()), lora)
