"""What a trainer rank holds: its place in the parallel layout and its parameter shards.

:func:`collect_shards` reads a live rank (model chunks + ``parallel_state``) through public
megatron-core APIs only; everything else in this package works on the plain, picklable
metadata it returns (:class:`RankTopology`, :class:`ShardMeta`), so planning is testable
without megatron and the sender daemon never touches the trainer's process groups.

megatron-core 0.16.1 facts this relies on (checked against real models on CPU):

- ``model.named_parameters()`` of a ``GPTModel`` chunk (after unwrapping DDP /
  ``Float16Module``, both of which hold the model as ``.module``) are the shards. Persistent
  buffers are shards too; the only one that matters is ``mlp.router.expert_bias`` (float32,
  kept float32 by the router even under bf16). ``local_tokens_per_expert`` is not persistent
  and is not collected. ``*._extra_state`` (TE / fp8 metadata) is never a tensor we send.
- State-dict layer indices (``decoder.layers.<i>.``) are local to the chunk. The global
  0-based layer index is ``model.decoder.layers[i].layer_number - 1`` (``layer_number`` is
  1-based and already includes the PP / VPP offset, also for uneven stages and layouts).
- MTP layers (``mtp.layers.<i>.``, built on the last stage) hold ``enorm``, ``hnorm``,
  ``eh_proj`` (column parallel ``[H, 2H]``, input ``cat(embedding, hidden)``), a full
  ``transformer_layer`` and ``final_layernorm``. Their ``transformer_layer.layer_number`` is
  ``num_layers + i + 1``: we record ``num_layers + i``, where GLM-4.5 / DeepSeek-V3 style
  checkpoints put MTP layer i.
- Tensor-parallel params carry ``tensor_model_parallel=True`` and ``partition_dim``; we record
  the latter so the planner can check it against its rule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from weightsync.dtypes import dtype_name
from weightsync.errors import PlanError

_LAYER_PREFIX = re.compile(r"^((?:decoder|mtp)\.layers\.\d+)\.")


@dataclass(frozen=True)
class RankTopology:
    """One trainer rank's coordinates in the parallel layout (ranks and sizes).

    Hashable: the offline converter keys rank states by it.
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    vpp_size: int = 1
    """Model chunks per rank (1 without virtual pipeline parallelism)."""
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    """Rank in the expert-tensor-parallel group (experts' own TP)."""
    etp_size: int = 1
    dp_rank: int = 0
    """Rank among the replicas of dense parameters (data parallel, context parallel included).
    Only ``dp_rank == 0`` writes dense parameters."""
    dp_size: int = 1
    edp_rank: int = 0
    """Rank among the replicas of expert parameters. Only ``edp_rank == 0`` writes experts."""
    edp_size: int = 1

    def __post_init__(self) -> None:
        for group in ("tp", "pp", "ep", "etp", "dp", "edp"):
            rank, size = getattr(self, f"{group}_rank"), getattr(self, f"{group}_size")
            if size < 1 or not 0 <= rank < size:
                raise PlanError(
                    f"rank topology: {group}_rank={rank} is not in [0, {group}_size={size})"
                )
        if self.vpp_size < 1:
            raise PlanError(f"rank topology: vpp_size={self.vpp_size} must be >= 1")

    def describe(self) -> str:
        """Short coordinates for error messages, e.g. ``tp1/2 pp0/2 ep0/1``."""
        parts = [f"tp{self.tp_rank}/{self.tp_size}", f"pp{self.pp_rank}/{self.pp_size}"]
        if self.ep_size > 1 or self.etp_size > 1:
            parts += [f"ep{self.ep_rank}/{self.ep_size}", f"etp{self.etp_rank}/{self.etp_size}"]
        if self.dp_size > 1 or self.edp_size > 1:
            parts += [f"dp{self.dp_rank}/{self.dp_size}", f"edp{self.edp_rank}/{self.edp_size}"]
        return " ".join(parts)


@dataclass(frozen=True)
class ShardMeta:
    """One local parameter (or persistent buffer) of a model chunk, as Megatron names it."""

    name: str
    """Megatron name inside the chunk, e.g. ``decoder.layers.0.self_attention.linear_qkv.weight``
    (layer indices local to the chunk)."""
    vpp_chunk: int
    """Index of the model chunk in the rank's chunk list (the virtual pipeline stage)."""
    layer: int | None
    """Global 0-based layer index (``layer_number - 1``) for ``decoder.layers`` params and
    ``num_layers + i`` for ``mtp.layers.<i>`` params; None for embeddings, final norm and
    output layer."""
    dtype: str
    """Wire dtype name (see :mod:`weightsync.dtypes`)."""
    shape: tuple[int, ...]
    partition_dim: int | None = None
    """Megatron's ``partition_dim`` for tensor-parallel params; None when not TP-partitioned."""

    def __post_init__(self) -> None:
        if self.name.endswith("_extra_state"):
            raise PlanError(f"{self.name!r}: _extra_state is not a weight; do not register it")

    @property
    def key(self) -> str:
        """Unique on its rank (one name can occur in two VPP chunks): ``"<chunk>:<name>"``."""
        return f"{self.vpp_chunk}:{self.name}"


@dataclass(frozen=True)
class LocalShards:
    """Everything one rank contributes: where it sits, its shards and their live tensors."""

    topology: RankTopology
    shards: tuple[ShardMeta, ...]
    tensors: Mapping[str, torch.Tensor] = field(repr=False)
    """Live tensors by :attr:`ShardMeta.key` (the parameters themselves, not copies)."""
    tied_embeddings: bool | None = None
    """Megatron's ``share_embeddings_and_output_weights`` (None when unknown)."""


def topology_from_parallel_state(vpp_size: int = 1) -> RankTopology:
    """This rank's :class:`RankTopology`, read from megatron-core's ``parallel_state``."""
    from megatron.core import parallel_state as ps

    return RankTopology(
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        vpp_size=vpp_size,
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
        dp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
        edp_rank=ps.get_expert_data_parallel_rank(),
        edp_size=ps.get_expert_data_parallel_world_size(),
    )


def unwrap_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / ``Float16Module`` wrappers (each keeps it as ``.module``)."""
    model = chunk
    while not hasattr(model, "decoder") and isinstance(
        getattr(model, "module", None), torch.nn.Module
    ):
        model = model.module
    if not hasattr(model, "decoder"):
        raise PlanError(
            f"model chunk of type {type(chunk).__name__} holds no GPTModel (no `.decoder` after "
            "unwrapping `.module`); pass the chunks megatron's model provider returned"
        )
    return model


def _global_layer(model: torch.nn.Module, name: str, cache: dict[str, int]) -> int | None:
    """The 0-based global layer of parameter ``name``; ``cache`` (layer module prefix -> layer,
    one per chunk and collection) spares looking the module up for each of its parameters."""
    match = _LAYER_PREFIX.match(name)
    if match is None:
        return None
    prefix = match.group(1)
    if prefix not in cache:
        module = model.get_submodule(prefix)
        # an MTP layer counts from 1 itself; its transformer_layer continues the decoder's count
        module = getattr(module, "transformer_layer", module)
        layer_number = getattr(module, "layer_number", None)
        if not isinstance(layer_number, int):
            raise PlanError(f"{name!r}: module {prefix!r} has no integer layer_number")
        cache[prefix] = layer_number - 1
    return cache[prefix]


def shard_of(name: str, tensor: torch.Tensor, vpp_chunk: int, layer: int | None) -> ShardMeta:
    """The metadata of one named tensor (a parameter keeps its megatron TP attributes)."""
    partition_dim = None
    if getattr(tensor, "tensor_model_parallel", False):
        # GatedDeltaNet's conv1d, dt_bias and A_log are split on dim 0 without saying so
        # (only its sharded_state_dict names the axis).
        partition_dim = int(getattr(tensor, "partition_dim", 0))
    return ShardMeta(
        name=name,
        vpp_chunk=vpp_chunk,
        layer=layer,
        dtype=dtype_name(tensor.dtype),
        shape=tuple(tensor.shape),
        partition_dim=partition_dim,
    )


def collect_shards(
    model_chunks: Sequence[torch.nn.Module], topology: RankTopology | None = None
) -> LocalShards:
    """Metadata and live tensors of every parameter and persistent buffer this rank holds.

    Args:
        model_chunks: the rank's model chunks in VPP order (one without VPP), possibly wrapped
            in DDP / ``Float16Module``.
        topology: this rank's coordinates; read from ``parallel_state`` when None.
    """
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    if topology is None:
        topology = topology_from_parallel_state(vpp_size=len(model_chunks))
    shards: list[ShardMeta] = []
    tensors: dict[str, torch.Tensor] = {}
    tied: set[bool] = set()
    for vpp_chunk, chunk in enumerate(model_chunks):
        model = unwrap_model(chunk)
        if hasattr(model, "share_embeddings_and_output_weights"):
            tied.add(bool(model.share_embeddings_and_output_weights))
        persistent = set(model.state_dict(keep_vars=True))
        layers: dict[str, int] = {}
        named = list(model.named_parameters())
        named += [(n, b) for n, b in model.named_buffers() if n in persistent]
        for name, tensor in named:
            if name.endswith("_extra_state"):
                continue
            meta = shard_of(name, tensor, vpp_chunk, _global_layer(model, name, layers))
            shards.append(meta)
            tensors[meta.key] = tensor
    if len(tied) > 1:
        raise PlanError("model chunks disagree on share_embeddings_and_output_weights")
    return LocalShards(topology, tuple(shards), tensors, tied.pop() if tied else None)
