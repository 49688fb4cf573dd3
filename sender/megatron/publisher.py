"""``MegatronPublisher``: every trainer rank packs its own shards straight into the buckets.

Each rank plans once (its pieces of every HF tensor, :func:`plan_rank`), the ranks check
together once that their pieces cover every HF byte exactly once, and then every
``publish(version)`` is one :meth:`Publisher.publish_packed` per rank: the sender joins the
ranks by ``publisher_id`` and version and hands each the same buckets; each rank copies its
pieces into them. The sender never joins a trainer process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

import torch

from weightsync.buckets import Bucket
from weightsync.checksum import verify_copies
from weightsync.errors import ConfigError, PlanError, TransportError
from weightsync.manifest import VersionManifest
from weightsync.regions import Region, pack_regions, region_copies
from weightsync.sender.megatron.agree import run_agreed
from weightsync.sender.megatron.convert import check_shard_tensors
from weightsync.sender.megatron.lora_export import LoraExport
from weightsync.sender.megatron.pieces import piece_regions
from weightsync.sender.megatron.plan import RankPlan, check_coverage, plan_rank
from weightsync.sender.megatron.shards import collect_shards, topology_from_parallel_state
from weightsync.sender.publisher import Publisher, PublishResult


class MegatronPublisher:
    """Publishes a Megatron model as HF-named tensors; construct it on every trainer rank.

    Args:
        model_chunks: the model chunks this rank holds (VPP order), after
            ``parallel_state.initialize_model_parallel``.
        hf_config: the transformers config of the target HF model (``model_type`` picks the
            names; shapes are checked against it).
        address: the sender's ``unix:/path`` or ``host:port``.
        publisher_id: shared by every rank of this job (default: from the model type).
        dtype: the HF dtype; inferred from the shards when None.
        export_mtp: send multi-token-prediction layers under the draft model's names.
        lora: export the Megatron-Bridge LoRA adapter the chunks carry (PEFT names and
            config, announced with each version); required when they carry one.
        direct: offer tensors that are exactly one local shard (replicated norms, TP=1 layouts)
            for receivers on this host to copy straight from trainer memory.
        group: the torch.distributed group of all trainer ranks for the one-time coverage
            check (default: the world). Only construction uses it, never ``publish``.

    Raises:
        PlanError: a parameter without a rule, a shape the config contradicts, missing ranks
            or two ranks claiming the same bytes; raised on every rank at once, before any
            publish, naming each failed rank's coordinates (a rank that failed alone never
            leaves the others in a collective).
        TransportError: the sender did not answer on some rank (every rank raises it).
    """

    def __init__(
        self,
        model_chunks: Sequence[torch.nn.Module] | torch.nn.Module,
        hf_config: object,
        address: str,
        *,
        publisher_id: str | None = None,
        dtype: torch.dtype | str | None = None,
        export_mtp: bool = True,
        lora: LoraExport | None = None,
        direct: bool = False,
        group: object = None,
        connect_timeout_s: float = 10.0,
    ) -> None:
        import torch.distributed as dist

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
            )
            check_shard_tensors(self.plan, local.tensors)
            self._current_regions()  # a piece that does not fit its shard fails here
            return self.plan

        def where() -> str:
            return topology_from_parallel_state().describe()

        self._regions: tuple[tuple[int, ...], dict[str, list[Region]]] | None = None
        """(every local tensor's ``data_ptr``, the regions): taken again when any pointer moved."""
        run_agreed("planning the Megatron -> HF conversion", plan, where, PlanError, group)
        rank, world = 0, 1
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            _check_coverage_together(self.plan, world, group)
        else:
            check_coverage([self.plan])
        self.device = next(iter(self._tensors.values())).device
        self._direct = direct
        model_type = getattr(hf_config, "model_type", "model")
        self.publisher = run_agreed(
            f"connecting to the weightsync sender at {address}",
            lambda: Publisher(
                address,
                publisher_id=publisher_id or f"megatron-{model_type}-{world}",
                rank=rank,
                world_size=world,
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
        receiver applied the version). The ranks meet at the sender, not in a collective.
        """
        if version < 1:
            raise ConfigError(f"version must be >= 1, got {version}")
        manifest = VersionManifest(version, self.plan.manifest, self.plan.lora)
        regions = self._current_regions()

        what = f"version {version}, rank {self.publisher.rank}"

        def pack(bucket: Bucket, buffer: torch.Tensor) -> None:
            for entry in bucket.entries:
                if pieces := regions.get(entry.name):
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
        )

    def _current_regions(self) -> dict[str, list[Region]]:
        """Each HF tensor's pieces as views of the live parameters: the sender packs from them
        (receivers read whole ones, direct), and so does ``pack`` when the sender cannot map
        them. Taken again only when a parameter moved (a framework that offloads and reloads
        weights assigns new ``.data``); a new mapping makes the publisher offer them again."""
        ptrs = tuple(t.data_ptr() for t in self._tensors.values())
        if self._regions is None or self._regions[0] != ptrs:
            specs = {spec.name: spec for spec in self.plan.manifest}
            with torch.no_grad():
                regions = {
                    name: piece_regions(specs[name], pieces, self._tensors)
                    for name, pieces in self.plan.pieces.items()
                }
            self._regions = (ptrs, regions)
        return self._regions[1]

    def close(self) -> None:
        self.publisher.close()


def _check_coverage_together(plan: RankPlan, world: int, group: object) -> None:
    """Every rank checks every rank's pieces, so all raise the same error or none does."""
    import torch.distributed as dist

    mine = (plan.topology, plan.manifest, dict(plan.pieces), dict(plan.shards))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    check_coverage(
        [
            RankPlan(topology, manifest, MappingProxyType(pieces), MappingProxyType(shards))
            for topology, manifest, pieces, shards in gathered
        ]
    )
