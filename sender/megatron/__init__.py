"""Megatron-core -> HF conversion: shard metadata, per-module-kind rules, planning, packing.

Pure parts (``rules``, ``name_*``, ``plan``, ``coverage``, ``pieces``) never import
megatron-core; only :func:`collect_shards` / :func:`topology_from_parallel_state` read a live
trainer rank.
"""

from .convert import check_shard_tensors, convert_megatron_to_hf, gather_local_shards
from .coverage import check_coverage
from .dims import ModelDims
from .lora_export import LoraExport
from .pieces import CopyPiece, pack_pieces
from .plan import RankPlan, hf_dims, hf_manifest, plan_rank
from .publisher import MegatronPublisher
from .shards import (
    LocalShards,
    RankTopology,
    ShardMeta,
    collect_shards,
    shard_of,
    topology_from_parallel_state,
)

__all__ = [
    "CopyPiece",
    "LocalShards",
    "LoraExport",
    "MegatronPublisher",
    "ModelDims",
    "RankPlan",
    "RankTopology",
    "ShardMeta",
    "check_coverage",
    "check_shard_tensors",
    "collect_shards",
    "convert_megatron_to_hf",
    "gather_local_shards",
    "hf_dims",
    "hf_manifest",
    "pack_pieces",
    "plan_rank",
    "shard_of",
    "topology_from_parallel_state",
]
