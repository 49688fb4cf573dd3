"""``MegatronPublisher``: every trainer rank packs its own shards straight into the buckets.

Each rank plans once (its pieces of every HF tensor, :func:`plan_rank`), the ranks check
together once that their pieces cover every HF byte exactly once, and then every
``publish(version)`` is one :meth:`Publisher.publish_packed` per rank: the sender joins the
ranks by ``publisher_id`` and version and hands each the same buckets; each rank copies its
pieces into them. The sender never joins a trainer process group.

A trainer spanning hosts publishes through one sender per host: the same one-time exchange
tells every rank every rank's host, each HF tensor goes to the host whose ranks write it
(:func:`plan_hosts`, bytes balanced where several could), and each host's ranks publish only
their host's part to their host's sender, as that sender's ranks (host-local rank and world
size: a sender joins only the ranks that publish to it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

import torch

from weightsync.buckets import Bucket, TensorSpec
from weightsync.checksum import verify_copies
from weightsync.errors import ConfigError, PlanError, TransportError
from weightsync.fp8 import BlockFp8
from weightsync.manifest import VersionManifest
from weightsync.regions import Region, pack_regions, region_copies
from weightsync.sender.megatron.agree import run_agreed
from weightsync.sender.megatron.convert import check_shard_tensors
from weightsync.sender.megatron.coverage import plan_hosts
from weightsync.sender.megatron.fp8_pieces import RankFp8
from weightsync.sender.megatron.lora_export import LoraExport
from weightsync.sender.megatron.pieces import CopyPiece, piece_regions
from weightsync.sender.megatron.plan import RankPlan, plan_rank
from weightsync.sender.megatron.shards import collect_shards, topology_from_parallel_state
from weightsync.sender.publisher import Publisher, PublishResult
from weightsync.transports.broadcast import host_id as this_host_id

Regions = dict[str, list[Region]]


class MegatronPublisher:
    """Publishes a Megatron model as HF-named tensors; construct it on every trainer rank.

    Args:
        model_chunks: the model chunks this rank holds (VPP order), after
            ``parallel_state.initialize_model_parallel``.
        hf_config: the transformers config of the target HF model (``model_type`` picks the
            names; shapes are checked against it).
        address: the sender's ``unix:/path`` or ``host:port``; for a trainer spanning
            hosts, this host's sender, or every host's sender by host id.
        publisher_id: shared by every rank of this job (default: from the model type).
        dtype: the HF dtype; inferred from the shards when None.
        export_mtp: send multi-token-prediction layers under the draft model's names.
        lora: export the Megatron-Bridge LoRA adapter the chunks carry (PEFT names and
            config, announced with each version); required when they carry one.
        direct: let receivers on this host copy straight from trainer memory the tensors
            whose pieces are contiguous in the shards (whole ones, or pieces that tile them:
            TP shards, query groups), instead of the sender gathering them.
        group: the torch.distributed group of all trainer ranks for the one-time coverage
            check (default: the world). Only construction uses it, never ``publish``.
        host_id: this rank's host, which picks its sender (default: ``WEIGHTSYNC_HOST_ID``,
            else this machine's hostname and boot id, as senders and receivers name hosts).
            Ranks with one host id publish every tensor to one sender, as ever.
        offer_replicas: every rank offers every copy it holds (data-parallel replicas, and TP
            ranks' copies of norms and other replicated tensors), so receivers read from the
            copy on their own GPU and the sender packs from the one on its staging GPU. These
            copies must be equal, as Megatron keeps them (finish a distributed optimizer's
            overlapped parameter all-gather before publishing); False: only the ranks that
            send a tensor offer it.
        fp8: publish the weights it picks as block FP8 in an FP8 engine's checkpoint form
            (e4m3 values under the HF name, float32 ``weight_scale_inv`` block scales), as
            ``BlockFp8`` makes of the gathered HF tensors: each rank quantizes its own pieces
            on its device, every version. Each piece must cover whole blocks (TP splits in
            multiples of the block; head_dim 128 and FFN widths of 128 x TP do). On GPUs,
            unless ``direct``, the version begins while the ranks quantize: each piece is
            packed once the launch that writes it is done (``Publisher.publish``'s
            ``ready``), so the first buckets cross while the rest is quantized. With
            ``direct`` they quantize first, so receivers on the host may read in place.

    Raises:
        PlanError: a parameter without a rule, a shape the config contradicts, missing ranks
            or two ranks claiming the same bytes, an HF tensor written by ranks on several
            hosts (TP groups must stay within a host), with ``fp8`` a piece that cuts a
            block (naming the tensor and the piece); raised on every rank at once, before any
            publish, naming each failed rank's coordinates (a rank that failed alone never
            leaves the others in a collective).
        TransportError: the sender did not answer on some rank (every rank raises it).
    """

    def __init__(
        self,
        model_chunks: Sequence[torch.nn.Module] | torch.nn.Module,
        hf_config: object,
        address: str | Mapping[str, str],
        *,
        publisher_id: str | None = None,
        dtype: torch.dtype | str | None = None,
        export_mtp: bool = True,
        lora: LoraExport | None = None,
        direct: bool = False,
        group: object = None,
        connect_timeout_s: float = 10.0,
        host_id: str | None = None,
        offer_replicas: bool = True,
        fp8: BlockFp8 | None = None,
    ) -> None:
        import torch.distributed as dist

        self.host_id = host_id or this_host_id()
        self._fp8 = RankFp8(fp8) if fp8 is not None else None

        def plan() -> RankPlan:
            local = collect_shards(model_chunks)
            self._tensors = local.tensors
            self.plan = plan_rank(
                local.shards,
                local.topology,
                hf_config,
                dtype=dtype,
                tied_embeddings=local.tied_embeddings,
                export_mtp=export_mtp,
                lora=lora,
                every_replica=True,  # plan_hosts picks one replica per tensor
            )
            check_shard_tensors(self.plan, local.tensors)
            # A piece that does not fit fails here, one this rank writes or only holds.
            self._piece_regions(self.plan.manifest, _held(self.plan))
            if self._fp8 is not None:
                self._fp8.check(self.plan)
            return self.plan

        def where() -> str:
            return f"{topology_from_parallel_state().describe()} on host {self.host_id}"

        self._regions: tuple[tuple[int, ...], Regions, Regions] | None = None
        """(every local tensor's ``data_ptr``, the offered regions, the packed regions): taken
        again when any pointer moved."""
        run_agreed("planning the Megatron -> HF conversion", plan, where, PlanError, group)
        rank, world = 0, 1
        plans, hosts = [self.plan], [self.host_id]
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            plans, hosts = _gather_plans(self.plan, self.host_id, world, group)
        # Every rank checks and plans from the same gathered plans, so all raise the same
        # error or none does; each keeps its pieces of the replica that sends each tensor.
        narrowed, self.parts = plan_hosts(plans, hosts, self._fp8.wire if self._fp8 else None)
        every = _held(self.plan)
        self.plan = narrowed[rank]
        self._offered = every if offer_replicas else self.plan.pieces
        """What this rank offers, by HF name: every copy it holds, or the pieces it sends."""
        self._sends = self.parts.tensors_of(self.host_id)
        """This host's tensors (one tuple, so the wire manifest is converted once)."""
        self._part = self.parts.part_of(self.host_id)
        self._manifest = (
            VersionManifest(1, self._sends, self.plan.lora, self._part) if self._sends else None
        )
        """This host's manifest, checked once; each version is it at that version."""
        self.device = next(iter(self._tensors.values())).device
        self._direct = direct
        model_type = getattr(hf_config, "model_type", "model")
        # A sender joins the ranks that publish to it: this host's, numbered among themselves.
        local_rank, local_world = hosts[:rank].count(self.host_id), hosts.count(self.host_id)
        sender = _address_of(address, self.host_id, hosts)
        self.publisher = run_agreed(
            f"connecting to the weightsync sender at {sender}",
            lambda: Publisher(
                sender,
                publisher_id=publisher_id or f"megatron-{model_type}-{world}",
                rank=local_rank,
                world_size=local_world,
                connect_timeout_s=connect_timeout_s,
            ),
            where,
            TransportError,
            group,
        )

    def publish(
        self, version: int, *, wait: bool = False, timeout_s: float = 600.0
    ) -> PublishResult:
        """Publish the current weights as ``version``; every rank calls it (collective).

        Returns once this rank's bytes are out of its memory (``wait=True``: once every
        receiver of this host's sender applied the version). The ranks meet at their host's
        sender, not in a collective. Ranks of a host that sends no tensor return at once.
        """
        if version < 1:
            raise ConfigError(f"version must be >= 1, got {version}")
        if not self._sends:
            return PublishResult(version, 0.0, 0)
        manifest = self._manifest.at(version)
        regions, packed = self._offers()
        ready = self._fp8.ready() if self._fp8 is not None and not self._direct else None
        what = f"version {version}, rank {self.publisher.rank}"

        def pack(bucket: Bucket, buffer: torch.Tensor) -> None:
            for entry in bucket.entries:
                if pieces := packed.get(entry.name):
                    pack_regions(buffer, entry, pieces)
                    if not buffer.is_cuda:
                        copies = region_copies(buffer, entry, pieces)
                        verify_copies(f"{what}, bucket {bucket.index}", entry.name, copies)

        return self.publisher.publish_packed(
            manifest,
            pack,
            device=self.device,
            wait=wait,
            timeout_s=timeout_s,
            regions=regions,
            direct=self._direct,
            ready=ready,
        )

    @property
    def manifest(self) -> VersionManifest | None:
        """The tensors this rank's host sends (its part of a trainer spanning hosts), at
        version 1; None when it sends none."""
        return self._manifest

    def regions(self) -> Regions:
        """What this rank offers: each HF tensor's pieces it holds, as views of the live
        parameters; with ``offer_replicas``, every copy (its data-parallel replica's pieces,
        and its own copy of a tensor its TP group replicates). The sender packs from one copy
        of each piece; receivers read in place (direct) the copy nearest them. Taken again
        only when a parameter moved (a framework that offloads and reloads weights assigns
        new ``.data``); a new mapping makes the publisher offer them again. With ``fp8``, the
        quantized tensors' pieces are views of their values and scales, quantized now."""
        return self._offers()[0]

    def _offers(self) -> tuple[Regions, Regions]:
        """:meth:`_taken`'s regions, with ``fp8`` those of the pieces quantized now."""
        regions, packed = self._taken()
        if self._fp8 is not None:
            return self._fp8.quantize(regions, packed)
        return regions, packed

    def _taken(self) -> tuple[Regions, Regions]:
        """The offered regions, and those ``pack`` writes when the sender cannot map them
        (the pieces of the one replica that sends each tensor)."""
        ptrs = tuple(t.data_ptr() for t in self._tensors.values())
        if self._regions is None or self._regions[0] != ptrs:
            offered = self._piece_regions(self._sends, self._offered)
            packed = (
                offered
                if self._offered is self.plan.pieces
                else self._piece_regions(self._sends, self.plan.pieces)
            )
            self._regions = (ptrs, offered, packed)
        return self._regions[1], self._regions[2]

    def _piece_regions(
        self, specs: Iterable[TensorSpec], by_name: Mapping[str, Sequence[CopyPiece]]
    ) -> Regions:
        """The regions of ``by_name``'s pieces of ``specs`` (this host's part, when
        publishing)."""
        with torch.no_grad():
            return {
                spec.name: piece_regions(spec, pieces, self._tensors)
                for spec in specs
                if (pieces := by_name.get(spec.name))
            }

    def close(self) -> None:
        self.publisher.close()


def _held(plan: RankPlan) -> Mapping[str, tuple[CopyPiece, ...]]:
    """Every piece ``plan`` (planned with ``every_replica``) holds: written, or copies."""
    return {**plan.pieces, **plan.copies}


def _gather_plans(
    plan: RankPlan, host: str, world: int, group: object
) -> tuple[list[RankPlan], list[str]]:
    """Every rank's plan and host, by rank in ``group`` (one collective)."""
    import torch.distributed as dist

    mine = (
        plan.topology,
        plan.manifest,
        dict(plan.pieces),
        dict(plan.shards),
        plan.lora,
        dict(plan.replica_of),
        host,
    )
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    plans = [
        RankPlan(topology, manifest, *map(MappingProxyType, (pieces, shards)), lora, replicas)
        for topology, manifest, pieces, shards, lora, replicas, _ in gathered
    ]
    return plans, [h for *_, h in gathered]


def _address_of(address: str | Mapping[str, str], host: str, hosts: Sequence[str]) -> str:
    """``host``'s sender. A mapping is checked against every rank's host (the same on every
    rank), so all ranks raise the same ConfigError, not one of them alone."""
    if isinstance(address, str):
        return address
    missing = sorted(set(hosts) - set(address))
    if missing:
        raise ConfigError(
            f"address names no sender for trainer host(s) {', '.join(map(repr, missing))} "
            f"(it names {', '.join(map(repr, sorted(address))) or 'none'}); give every "
            "trainer host's sender, or set host_id / WEIGHTSYNC_HOST_ID to hosts it names"
        )
    return address[host]
