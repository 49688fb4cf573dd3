"""A described cluster (a model, a Megatron trainer, engine replicas, link rates) as the topology
planner's sources and receivers: which trainer ranks hold which box of each HF tensor, which
box each engine rank keeps.

Pure (no I/O): ``weightsync plan`` reads the file; :func:`plan_cluster` is
:func:`weightsync.topology.plan_topology` on what this module derives.

Trainer ranks follow Megatron's default order (``tp-cp-ep-dp-pp``: TP fastest, PP slowest; an
expert's ranks within a stage ``etp-ep-dp``) and fill hosts in rank order. Layers go to PP stages
in contiguous runs (``pp_layers``, else as even as can be, the first stages taking one more);
the embedding lives on the first stage, the final norm and ``lm_head`` on the last. An engine
replica is ``tp`` ranks; with ``ep`` > 1 its experts are split whole over ``ep`` groups of
``tp / ep`` ranks, each group splitting them by TP (vLLM's expert parallelism is ``ep == tp``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from weightsync.buckets import TensorSpec
from weightsync.errors import ConfigError
from weightsync.model_shapes import FP8_BLOCK, VOCAB_PADDING, ModelTensor, model_tensors
from weightsync.parts import PartsPlan, plan_parts
from weightsync.topology import (
    Box,
    LinkRates,
    Piece,
    Receiver,
    Source,
    TopologyPlan,
    plan_topology,
    shard_box,
    whole_box,
)

GB = 1e9


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    preset: str | None = Field(None, description="a named model: kimi-k2, deepseek-v3, ...")
    config: str | None = Field(
        None, description="path to an HF config.json (relative: to the file)"
    )

    @model_validator(mode="after")
    def _one(self) -> ModelSpec:
        if (self.preset is None) == (self.config is None):
            raise ValueError("give exactly one of preset or config")
        return self


class TrainerSpec(_Strict):
    hosts: int = Field(ge=1, description="trainer hosts")
    gpus_per_host: int = Field(ge=1, description="GPUs (ranks) per trainer host")
    tp: int = Field(1, ge=1, description="tensor parallel size (within a host)")
    pp: int = Field(1, ge=1, description="pipeline parallel size")
    ep: int = Field(1, ge=1, description="expert parallel size")
    expert_tp: int = Field(1, ge=1, description="expert tensor parallel size")
    dp: int | None = Field(None, ge=1, description="data parallel size (default: what is left)")
    pp_layers: list[int] | None = Field(None, description="decoder layers per PP stage")

    @property
    def world(self) -> int:
        return self.hosts * self.gpus_per_host

    @model_validator(mode="after")
    def _fits(self) -> TrainerSpec:
        if self.world % (self.tp * self.pp):
            raise ValueError(f"tp*pp={self.tp * self.pp} does not divide {self.world} GPUs")
        dp = self.world // (self.tp * self.pp)
        if self.dp is not None and self.dp != dp:
            raise ValueError(f"dp={self.dp}, but hosts*gpus_per_host/(tp*pp) = {dp}")
        if self.gpus_per_host % self.tp:
            raise ValueError(
                f"tp={self.tp} must divide gpus_per_host={self.gpus_per_host}: "
                "a TP group spanning hosts is not supported"
            )
        if (self.tp * dp) % (self.ep * self.expert_tp):
            raise ValueError(
                f"ep*expert_tp={self.ep * self.expert_tp} must divide tp*dp={self.tp * dp}"
            )
        if self.pp_layers is not None and (
            len(self.pp_layers) != self.pp or min(self.pp_layers) < 0
        ):
            raise ValueError(f"pp_layers needs {self.pp} non-negative counts, one per stage")
        return self


class EngineSpec(_Strict):
    replicas: int = Field(ge=1, description="engine replicas (each needs the whole model)")
    tp: int = Field(ge=1, description="ranks (GPUs) per replica: its tensor parallel size")
    ep: int = Field(1, ge=1, description="expert parallel size in a replica (divides tp)")
    gpus_per_host: int = Field(ge=1, description="engine GPUs per host")
    dtype: Literal["bf16", "fp8"] = Field("bf16", description="bf16, or fp8 with block scales")

    @model_validator(mode="after")
    def _fits(self) -> EngineSpec:
        if self.tp % self.ep:
            raise ValueError(f"ep={self.ep} must divide tp={self.tp}")
        if self.tp % self.gpus_per_host and self.gpus_per_host % self.tp:
            raise ValueError(
                f"tp={self.tp} and gpus_per_host={self.gpus_per_host}: one must divide the other"
            )
        return self


class LinksSpec(_Strict):
    nic_gb_s: float = Field(50.0, gt=0, description="each GPU's NIC, GB/s per direction")
    nvlink_gb_s: float = Field(350.0, gt=0, description="each GPU's NVLink, GB/s per direction")
    hbm_gb_s: float = Field(2000.0, gt=0, description="a copy inside one GPU, GB/s")
    host_nic_gb_s: float | None = Field(None, gt=0, description="all NICs of a host together")

    def rates(self) -> LinkRates:
        host = None if self.host_nic_gb_s is None else self.host_nic_gb_s * GB
        return LinkRates(
            hbm=self.hbm_gb_s * GB,
            nvlink_out=self.nvlink_gb_s * GB,
            nvlink_in=self.nvlink_gb_s * GB,
            nic_out=self.nic_gb_s * GB,
            nic_in=self.nic_gb_s * GB,
            host_out=host,
            host_in=host,
        )


class Topology(_Strict):
    """A ``weightsync plan --topology`` file."""

    model: ModelSpec
    trainer: TrainerSpec
    engines: EngineSpec
    links: LinksSpec = LinksSpec()
    transfer: Literal["broadcast", "p2p"] = Field(
        "broadcast", description="cross-host: one broadcast per slice, or a read per receiver"
    )


def _stage_of_layers(t: TrainerSpec, layers: int) -> list[int]:
    counts = t.pp_layers or [layers // t.pp + (s < layers % t.pp) for s in range(t.pp)]
    if sum(counts) != layers:
        raise ConfigError(
            f"trainer.pp_layers adds up to {sum(counts)}; the model has {layers} layers"
        )
    return [s for s, n in enumerate(counts) for _ in range(n)]


def tp_box(t: ModelTensor, rank: int, world: int, weights: Mapping[str, ModelTensor]) -> Box:
    """The box of ``t`` that TP rank ``rank`` of ``world`` keeps; an FP8 scale: the blocks of
    its weight's box."""
    if t.scale_of is not None:
        w = weights[t.scale_of]
        return _box(w.shape, w.split, w.heads, rank, world, True)
    return _box(t.shape, t.split, t.heads, rank, world, False)


@lru_cache(maxsize=1 << 16)  # a model repeats a few shapes thousands of times
def _box(
    shape: tuple[int, ...], split: str, heads: int, rank: int, world: int, blocks: bool
) -> Box:
    if blocks:
        w = _box(shape, split, heads, rank, world, False)
        lo = tuple(a // FP8_BLOCK for a in w.start)
        hi = tuple(-(-b // FP8_BLOCK) for b in w.stop)
        return Box(lo, tuple(b - a for a, b in zip(lo, hi, strict=True)))
    if split == "replicated" or world == 1:
        return whole_box(shape)
    if heads and world > heads:  # fewer heads than ranks: each rank keeps one whole head
        rows = shape[0] // heads
        head = rank * heads // world
        return Box((head * rows, *(0,) * (len(shape) - 1)), (rows, *shape[1:]))
    if split == "vocab":
        per = -(-(-(-shape[0] // VOCAB_PADDING) * VOCAB_PADDING) // world)
        lo = min(rank * per, shape[0])
        return Box((lo, *(0,) * (len(shape) - 1)), (min(lo + per, shape[0]) - lo, *shape[1:]))
    return shard_box(shape, 0 if split == "column" else 1, rank, world)


def cluster(
    topo: Topology, config: Mapping[str, Any]
) -> tuple[tuple[ModelTensor, ...], list[Source], list[Receiver]]:
    """The manifest, the trainer's sources and the engines' receivers of ``topo``."""
    tensors = model_tensors(config, fp8=topo.engines.dtype == "fp8")
    by_name = {t.name: t for t in tensors}
    experts = 1 + max((t.expert for t in tensors if t.expert is not None), default=-1)
    for who, ep in (("trainer", topo.trainer.ep), ("engines", topo.engines.ep)):
        if experts and experts % ep:
            raise ConfigError(f"{who}.ep={ep} must divide the model's {experts} experts")
        if not experts and ep > 1:
            raise ConfigError(f"{who}.ep={ep}, but the model has no experts")
    return (
        tensors,
        _sources(topo.trainer, tensors, by_name, experts),
        _receivers(topo.engines, tensors, by_name, experts),
    )


def _sources(
    t: TrainerSpec, tensors: tuple[ModelTensor, ...], by_name: dict[str, ModelTensor], experts: int
) -> list[Source]:
    layers = 1 + max(x.layer for x in tensors if x.layer is not None)
    stage_of = _stage_of_layers(t, layers)
    dp = t.world // (t.tp * t.pp)
    stage_ranks = t.tp * dp
    edp = stage_ranks // (t.ep * t.expert_tp)
    pieces: list[list[Piece]] = [[] for _ in range(t.world)]
    seen_layer = False
    for x in tensors:
        seen_layer = seen_layer or x.layer is not None
        stage = stage_of[x.layer] if x.layer is not None else (t.pp - 1 if seen_layer else 0)
        base = stage * stage_ranks
        if x.expert is None:
            shards = [Piece(x.name, tp_box(x, tp, t.tp, by_name)) for tp in range(t.tp)]
            for local in range(stage_ranks):
                pieces[base + local].append(shards[local % t.tp])
            continue
        ep_rank = x.expert // (experts // t.ep)
        for etp in range(t.expert_tp):
            piece = Piece(x.name, tp_box(x, etp, t.expert_tp, by_name))
            for d in range(edp):
                pieces[base + etp + t.expert_tp * (ep_rank + t.ep * d)].append(piece)
    return [
        Source(r, f"trainer-{r // t.gpus_per_host}/gpu{r % t.gpus_per_host}",
               f"trainer-{r // t.gpus_per_host}", tuple(ps))
        for r, ps in enumerate(pieces)
    ]  # fmt: skip


def _receivers(
    e: EngineSpec, tensors: tuple[ModelTensor, ...], by_name: dict[str, ModelTensor], experts: int
) -> list[Receiver]:
    etp = e.tp // e.ep
    needs: list[list[Piece]] = [[] for _ in range(e.tp)]
    for x in tensors:
        if x.expert is None:
            for rank in range(e.tp):
                needs[rank].append(Piece(x.name, tp_box(x, rank, e.tp, by_name)))
            continue
        group = x.expert // (experts // e.ep)
        for rank in range(group * etp, (group + 1) * etp):
            needs[rank].append(Piece(x.name, tp_box(x, rank % etp, etp, by_name)))
    shared = [tuple(ps) for ps in needs]  # one tuple per rank: the planner walks each once
    out = []
    for k in range(e.replicas):
        for rank in range(e.tp):
            g = k * e.tp + rank
            host = f"engine-{g // e.gpus_per_host}"
            out.append(
                Receiver(f"r{k}/tp{rank}", f"{host}/gpu{g % e.gpus_per_host}", host, shared[rank])
            )
    return out


Built = tuple[tuple[ModelTensor, ...], list[Source], list[Receiver]]
"""What :func:`cluster` derives: the manifest, the sources and the receivers."""


def plan_cluster(topo: Topology, config: Mapping[str, Any]) -> TopologyPlan:
    """The plan the senders would run for ``topo`` (``config``: the model's HF config)."""
    return plan_built(topo, cluster(topo, config))


def plan_built(topo: Topology, built: Built) -> TopologyPlan:
    """:func:`plan_cluster` of an already derived ``cluster(topo, config)``."""
    return plan_topology(*built, topo.links.rates(), broadcast=topo.transfer == "broadcast")


@dataclass(frozen=True)
class RuntimeEstimate:
    """What the multi-host runtime as built moves for a cluster, from its second version on: a
    sender per trainer host (:func:`weightsync.parts.plan_parts` gives each HF tensor to one host
    holding a whole copy), each packing its part on one staging GPU and broadcasting, to every
    group of engine ranks that keep the same boxes (``transports/broadcast/slices.py``: the same
    TP rank of every replica), the boxes of its part that group keeps (NCCL's ring: each member
    takes its bytes in once and passes them on once). The first version goes whole, while the ranks
    declare what they keep. Unlike :func:`plan_cluster`'s plan, a box is not relayed between
    engine hosts, and each trainer host sends from one GPU's NIC."""

    parts: PartsPlan
    sent: Mapping[str, int]
    """Bytes each trainer host's sender sends (all its groups' boxes of its part)."""
    taken: int
    """Bytes the engine GPU that keeps the most takes in."""
    nic_bytes_per_s: float

    @property
    def busiest_part(self) -> tuple[str, int]:
        """The trainer host sending the most, and its bytes (out of its staging GPU's NIC)."""
        host = max(self.sent, key=lambda h: (self.sent[h], h))
        return host, self.sent[host]

    @property
    def predicted_s(self) -> float:
        return max(self.taken, self.busiest_part[1]) / self.nic_bytes_per_s

    @property
    def bound(self) -> str:
        host, sent = self.busiest_part
        if sent >= self.taken:
            return f"trainer host {host}'s sender sending its part's slices from one GPU"
        return "the engine GPU keeping the most taking its slices through its NIC"


def runtime_estimate(topo: Topology, built: Built) -> RuntimeEstimate:
    """The multi-host runtime's cost for ``topo`` (``built``: its ``cluster(topo, config)``):
    the parts its senders would send (the same :func:`~weightsync.parts.plan_parts` the
    Megatron publishers run) and the bytes each link carries.

    Raises:
        PlanError: a tensor no one trainer host holds whole (a TP group spanning hosts), as the
            publishers would refuse it.
    """
    tensors, sources, receivers = built
    boxes: dict[str, dict[str, set[Box]]] = defaultdict(lambda: defaultdict(set))
    for source in sources:
        for piece in source.pieces:
            boxes[piece.tensor][source.host].add(piece.box)
    # A host holds a whole copy when its distinct pieces (TP shards, which tile the tensor) add
    # up to it; a copy split over hosts gives plan_parts one multi-host copy, which it refuses.
    copies: dict[str, list[set[str]]] = {}
    for t in tensors:
        numel = whole_box(t.shape).numel  # an FP8 scale's shape is its weight's block grid
        held = boxes.get(t.name, {})
        whole = [{h} for h, bs in held.items() if sum(b.numel for b in bs) >= numel]
        copies[t.name] = whole or [set(held)]
    manifest = [TensorSpec(t.name, t.dtype, t.shape) for t in tensors]
    parts = plan_parts(manifest, copies)
    host_of = {spec.name: host for host, specs in parts.parts.items() for spec in specs}
    itemsize = {t.name: t.nbytes // whole_box(t.shape).numel for t in tensors}
    whole = tuple(Piece(t.name, whole_box(t.shape)) for t in tensors)
    sent: dict[str, int] = dict.fromkeys(parts.hosts, 0)
    taken = 0
    # Ranks that keep the same boxes form one group: each sender sends it its boxes once.
    # (Replicas share their ranks' needs: compare each distinct tuple once.)
    for needs in set({id(r.needs): r.needs or whole for r in receivers}.values()):
        for piece in needs:
            sent[host_of[piece.tensor]] += piece.box.numel * itemsize[piece.tensor]
        taken = max(taken, sum(p.box.numel * itemsize[p.tensor] for p in needs))
    return RuntimeEstimate(parts, sent, taken, topo.links.nic_gb_s * GB)
