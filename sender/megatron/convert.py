"""The offline converter: Megatron shards of every rank -> one HF state dict, no service needed.

It runs exactly the code the sender runs (``plan_rank`` per rank, ``check_coverage``,
``plan_buckets``, ``pack_pieces`` per bucket entry), so a layout that converts here publishes
the same bytes.

Typical use, at the end of a training job (every rank)::

    local = collect_shards(model_chunks)              # this rank's metadata + live tensors
    states = gather_local_shards(local)               # rank 0: {RankTopology: LocalShards}
    if states is not None:
        hf = convert_megatron_to_hf(states, AutoConfig.from_pretrained(path))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from weightsync.buckets import ChunkAssembler, align_up, plan_buckets, unpack_bucket
from weightsync.dtypes import dtype_name
from weightsync.errors import PlanError, WeightSyncError

from .agree import run_agreed
from .coverage import check_coverage
from .lora_export import LoraExport
from .pieces import pack_pieces
from .plan import RankPlan, plan_rank
from .shards import LocalShards, RankTopology, ShardMeta

RankState = LocalShards | tuple[Sequence[ShardMeta], Mapping[str, torch.Tensor]]


def check_shard_tensors(plan: RankPlan, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise PlanError naming the first shard whose tensor is missing or mismatches its metadata."""
    for key, meta in plan.shards.items():
        tensor = tensors.get(key)
        if tensor is None:
            raise PlanError(
                f"Megatron parameter {meta.name!r} (chunk {meta.vpp_chunk}) has no tensor"
            )
        if tuple(tensor.shape) != meta.shape or dtype_name(tensor.dtype) != meta.dtype:
            raise PlanError(
                f"Megatron parameter {meta.name!r} is {tuple(tensor.shape)} {tensor.dtype}, but "
                f"its metadata says {meta.shape} {meta.dtype}; collect the shards again"
            )


def convert_megatron_to_hf(
    rank_state: Mapping[RankTopology, RankState],
    hf_config: object,
    *,
    dtype: torch.dtype | str | None = None,
    bucket_size_bytes: int | None = None,
    export_mtp: bool = True,
    lora: LoraExport | None = None,
) -> dict[str, torch.Tensor]:
    """Convert the shards of all Megatron ranks into an HF state dict.

    Args:
        rank_state: one entry per trainer rank, keyed by its :class:`RankTopology`; the value
            is its :class:`LocalShards` or a ``(shards metadata, {shard key: tensor})`` pair.
            Data-parallel replicas may be included or left out (only ``dp_rank == 0`` /
            ``edp_rank == 0`` write).
        hf_config: the target transformers config (``model_type`` selects the names).
        dtype: the HF model dtype; inferred from the shards when None (the router's expert
            bias stays float32).
        bucket_size_bytes: pack through buckets of this cap (the service path, chunking
            included); default one bucket holding everything.
        export_mtp: include multi-token-prediction layers; False skips them.
        lora: export the LoRA adapter the shards carry (PEFT names, see :class:`LoraExport`);
            its adapter config is ``plan_rank(..., lora=...).lora``.

    Returns:
        ``{hf name: tensor}`` in manifest order; with the default single bucket the tensors
        are views of one buffer.

    Raises:
        PlanError: a parameter without a rule, a shape the config contradicts, missing ranks,
            or two ranks claiming the same bytes (the message names the tensor or parameter).
    """
    if not rank_state:
        raise PlanError("rank_state is empty: pass the shards of every trainer rank")
    plans: list[RankPlan] = []
    tensors: list[Mapping[str, torch.Tensor]] = []
    for topology, state in rank_state.items():
        if isinstance(state, LocalShards):
            shards, local, tied = state.shards, state.tensors, state.tied_embeddings
        else:
            (shards, local), tied = state, None
        plan = plan_rank(
            shards,
            topology,
            hf_config,
            dtype=dtype,
            tied_embeddings=tied,
            export_mtp=export_mtp,
            lora=lora,
        )
        check_shard_tensors(plan, local)
        plans.append(plan)
        tensors.append(local)
    check_coverage(plans)
    manifest = plans[0].manifest
    total = max(sum(align_up(spec.nbytes) for spec in manifest), 256)
    buckets = plan_buckets(manifest, bucket_size_bytes or align_up(total))
    device = next((t.device for local in tensors for t in local.values()), torch.device("cpu"))
    out: dict[str, torch.Tensor] = {}
    assembler = ChunkAssembler()
    for bucket in buckets.buckets:
        buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=device)
        for entry in bucket.entries:
            for plan, local in zip(plans, tensors, strict=True):
                pack_pieces(buffer, entry, plan.pieces_for(entry.name), local)
        out.update(unpack_bucket(buffer, bucket, assembler))
    return {spec.name: out[spec.name] for spec in manifest}


def gather_local_shards(
    local: LocalShards, dst: int = 0, group: object = None
) -> dict[RankTopology, LocalShards] | None:
    """Collect every rank's shards (copied to CPU) on rank ``dst`` of ``group``; None elsewhere.

    A collective over ``group`` (default: the world): call it on every rank, outside any
    other collective. Meant for offline checks of small models, not for the service path.

    Raises:
        WeightSyncError: on every rank, when the copy failed on any (naming it).
    """
    import torch.distributed as dist

    def copy_to_cpu() -> LocalShards:
        cpu = {k: t.detach().to("cpu", copy=True) for k, t in local.tensors.items()}
        return LocalShards(local.topology, local.shards, cpu, local.tied_embeddings)

    mine = run_agreed(
        "copying the shards to the CPU",
        copy_to_cpu,
        local.topology.describe,
        WeightSyncError,
        group,
    )
    rank = dist.get_rank(group)
    gathered: list[LocalShards | None] | None = (
        [None] * dist.get_world_size(group) if rank == dst else None
    )
    dist.gather_object(
        mine, gathered, dst=dist.get_global_rank(group, dst) if group else dst, group=group
    )
    if gathered is None:
        return None
    states: dict[RankTopology, LocalShards] = {}
    for state in gathered:
        if state is None:
            continue
        if state.topology in states:
            raise PlanError(f"two ranks report the same coordinates {state.topology.describe()}")
        states[state.topology] = state
    return states
