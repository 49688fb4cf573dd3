"""Driving a ``WeightTarget`` without a sender: manifests, random weights, and ``drive``, which
hands a version to a target bucket by bucket the way the receiver core does."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from weightsync.buckets import ChunkAssembler, TensorSpec, pack_entry, plan_buckets, unpack_bucket
from weightsync.manifest import LoraAdapterSpec, VersionManifest
from weightsync.receiver.target import Arrival


def manifest_of(
    version: int, tensors: Mapping[str, torch.Tensor], lora: LoraAdapterSpec | None = None
) -> VersionManifest:
    """The manifest of ``tensors`` (in their order) as version ``version``."""
    return VersionManifest(version, tuple(TensorSpec.of(n, t) for n, t in tensors.items()), lora)


def random_weights(
    template: Mapping[str, torch.Tensor] | Iterable[TensorSpec], seed: int
) -> dict[str, torch.Tensor]:
    """New random tensors with the names, shapes and dtypes of ``template`` (tensors or specs).

    Vectors are near 1 (norm weights), matrices scaled by 1.5 / sqrt(fan-in): large enough
    that greedy generation is not one repeated token.
    """
    if isinstance(template, Mapping):
        specs = [TensorSpec.of(name, t) for name, t in template.items()]
    else:
        specs = list(template)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for spec in specs:
        if len(spec.shape) <= 1:
            t = 1.0 + 0.1 * torch.randn(spec.shape, generator=gen)
        else:
            t = torch.randn(spec.shape, generator=gen) * (1.5 / spec.shape[-1] ** 0.5)
        out[spec.name] = t.to(spec.torch_dtype)
    return out


def drive(
    target, manifest: VersionManifest, tensors: Mapping[str, torch.Tensor], bucket_size_bytes: int
) -> int:
    """validate -> begin -> load per bucket -> commit, as the receiver core does (``abort``
    when anything after ``validate`` fails); returns the number of load calls.

    Buckets are planned and packed by ``weightsync.buckets`` into ONE reused buffer, which is
    scribbled over (NaN for float32) after each load, so a target keeping views instead of
    copies is caught; tensors larger than a bucket arrive chunked and are reassembled.
    """
    target.validate(manifest)
    plan = plan_buckets(manifest.tensors, bucket_size_bytes)
    buffer = torch.empty(bucket_size_bytes, dtype=torch.uint8)
    assembler = ChunkAssembler()
    try:
        target.begin(manifest)
        for bucket in plan.buckets:
            for entry in bucket.entries:
                pack_entry(buffer, entry, tensors[entry.name])
            target.load(Arrival(tuple(unpack_bucket(buffer, bucket, assembler))))
            buffer.fill_(0xFF)  # the next bucket reuses the buffer
        target.commit(manifest)
    except Exception as e:
        target.abort(manifest, e)
        raise
    return len(plan.buckets)
