"""The node case with a real Megatron trainer (issue 32): ``weightsync bench --gpus N --megatron``.

The same run as :mod:`.node` (a publisher rank process per GPU, an engine-like receiver per
GPU, direct reads over CUDA IPC, every version checked bit for bit), but each publisher rank
is a rank of a real megatron-core job: the N rank processes join one process group (NCCL;
gloo on CPU), megatron's parallel state is TP=T x DP=N/T (MoE: experts over EP ranks, expert
TP=1), and each holds its ``GPTModel`` (:mod:`.megatron_model`) in megatron's DDP parameter
buffers (the distributed optimizer's layout: a few contiguous buffers per rank) and publishes
through ``MegatronPublisher`` with ``direct``: receivers read its shards in place where it
offers them, as a real trainer's would be. Its rows sit beside the synthetic trainer's rows
of the same layout and are held to the same floors, measured by the synthetic run.

Every version the ranks fill their parameters by HF name: version v of HF tensor i is
:func:`~.hosts.fill_version`'s bytes, written through the publisher's own regions (each
rank's views of its shards, every copy it holds), so a receiver computes what it must hold
from the name alone, no gather. The regions are the conversion's, so this checks the move,
not the Megatron -> HF rules (the integration tests check those against transformers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightsync.app.bench import node
from weightsync.app.bench.children import scratch_dir
from weightsync.app.bench.hosts import fill_version
from weightsync.app.bench.models import ModelShape, hf_specs
from weightsync.app.bench.report import MEGATRON
from weightsync.app.bench.worker import sync
from weightsync.errors import ConfigError


@dataclass(frozen=True)
class MegatronTrainer:
    """The node case's trainer: a megatron-core job of TP ``tp`` (EP ``ep`` for MoE) whose
    ranks meet at the file ``rendezvous``."""

    tp: int
    ep: int
    rendezvous: str
    case = MEGATRON

    note = "megatron-core GPTModel in DDP buffers; "  # its EP is in the row's layout

    def publish(self, shape, rank, world, device, address, timeout_s, commands, out) -> None:
        """Rank ``rank`` of ``world``: publish each version ``commands`` gives until None."""
        from weightsync.app.bench import megatron_model as mm
        from weightsync.sender.megatron import MegatronPublisher

        cuda = device.type == "cuda"
        mm.init_ranks(rank, world, self.rendezvous, self.tp, self.ep, cuda)
        try:
            model = mm.in_param_buffers(mm.build_model(shape, self.tp, self.ep, device))
            publisher = MegatronPublisher(
                [model], mm.hf_config(shape), address, publisher_id="node-megatron", direct=cuda
            )
            try:
                while (version := commands.get()) is not None:
                    _fill(publisher.regions(), shape, version)
                    sync(device)
                    result = publisher.publish(version, wait=True, timeout_s=timeout_s)
                    out.put(("published", rank, result.status.SerializeToString()))
            finally:
                publisher.close()
        finally:
            mm.close_ranks()

    def check(self, shape: ModelShape, device: torch.device):
        """A receiver's check of each version: ``(target, version) -> ""`` or what differs."""
        expected = _Expected(shape, device)

        def check(target, version: int) -> str:
            expected.version = version
            return target.mismatch(expected.specs, expected, version)

        return check


class _Expected:
    """Version ``version`` of an HF tensor by name, made on ``device`` when asked."""

    def __init__(self, shape: ModelShape, device: torch.device) -> None:
        self.specs = {s.name: s for s in hf_specs(shape)}
        self.order = {name: i for i, name in enumerate(self.specs)}
        self.device, self.version = device, 0

    def __call__(self, name: str) -> torch.Tensor:
        spec = self.specs[name]
        tensor = torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.device)
        fill_version(tensor, self.order[name], self.version)
        return tensor


@torch.no_grad()
def _fill(regions, shape: ModelShape, version: int) -> None:
    """Write version ``version`` of every HF tensor into the shards ``regions`` view (a rank's
    offered regions by HF name): one whole tensor made at a time, its boxes copied out."""
    expected = _Expected(shape, next(iter(regions.values()))[0].source.device)
    expected.version = version
    for name, parts in regions.items():
        full = expected(name)
        for region in parts:
            box = tuple(
                slice(start, start + n)
                for start, n in zip(region.dst_start, region.source.shape, strict=True)
            )
            region.source.copy_(full[box])


def measure_megatron_node(
    shape: ModelShape,
    gpus: int,
    versions: int,
    warmup: int,
    timeout_s: float,
    engine_tp: int = 1,
    trainer_tp: int = 1,
    ep: int = 2,
    cpu: bool = False,
) -> node.NodeRun:
    """The node case on GPUs 0..``gpus``-1 (``cpu``: ``gpus`` ranks on the CPU, over gloo and
    shm) with a megatron-core trainer of TP ``trainer_tp`` (MoE: EP ``ep``, expert TP=1);
    ``warmup`` + ``versions`` versions. No floors: the synthetic run of the layout measures
    them.

    Raises:
        ConfigError: an EP size that does not divide ``gpus`` or the experts.
    """
    ep = ep if shape.is_moe else 1
    if ep < 1 or gpus % ep or (shape.is_moe and shape.experts % ep):
        raise ConfigError(
            f"--megatron-ep {ep}: give a size dividing --gpus {gpus} and {shape.experts} experts"
        )
    with scratch_dir("ws-megatron-") as directory:
        trainer = MegatronTrainer(trainer_tp, ep, f"{directory}/ranks")
        return node.measure_node(
            shape,
            gpus,
            versions,
            warmup,
            0,
            timeout_s,
            engine_tp,
            devices=0 if cpu else None,
            trainer=trainer,
        )
