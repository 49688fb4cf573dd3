"""A trainer's weights published as block FP8, each weight quantized straight into the staging
bucket the sender asks this publisher to pack (issue 36).

``publisher.publish(BlockFp8()(tensors), v)`` quantizes every weight before the version
begins and offers the results: the sender packs them, or receivers read them in place. The
quantization's own pass then comes before the first byte moves (4.8 ms for the 7B shape on an
H200, the whole of what FP8 across a link lost against its byte ratio). Here the version
begins at once, without offering the trainer's memory, and the sender asks this publisher for
each bucket in turn: its weights are quantized into it while the bucket before crosses the
link, every bf16 byte read once and every e4m3 byte written once, into the bucket.

The bytes are ``BlockFp8``'s. Where a bucket holds a weight's values but not its scales (or
the reverse), or a chunk of a weight, that weight is quantized whole once per version and the
entries copied from the result.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from weightsync import fp8_kernel
from weightsync.buckets import Bucket, BucketEntry, TensorSpec, entry_view, pack_entry
from weightsync.errors import ConfigError
from weightsync.fp8 import FP8, BlockFp8, quantize_block_fp8, scale_name, scale_shape
from weightsync.manifest import VersionManifest
from weightsync.memo import Memo, Same
from weightsync.sender.publisher import Publisher, PublishResult
from weightsync.tensor_keys import SameTensors, layout_key


@dataclass(frozen=True)
class _Form:
    """What a layout of the trainer's tensors is published as."""

    key: tuple
    """:func:`layout_key` of the tensors it was made for."""
    manifest: VersionManifest
    weights: Mapping[str, str]
    """Each quantized weight's values and scales, by name: the weight's name."""


class Fp8Packs:
    """Publishes a trainer's tensors in an FP8 engine's checkpoint form (``fp8``'s: e4m3
    values and ``weight_scale_inv`` for each weight it picks, every other tensor as it is),
    quantizing each weight into the bucket that carries it as the sender asks for it.

    Use it where the bytes cross a link (receivers on other GPUs or hosts): the quantization
    then overlaps the transfer. On the trainer's own GPU, where the receiver's copy is the
    cost, quantizing first (``publisher.publish(fp8(tensors), v)``) lets the sender write the
    receiver's weights in its pack and is the faster of the two.
    """

    def __init__(self, fp8: BlockFp8 | None = None) -> None:
        self.fp8 = fp8 or BlockFp8()
        self._form: _Form | None = None
        self._same: SameTensors | None = None
        self._plans: Memo[tuple[Same, int], _BucketPlan] = Memo(MAX_PLANS)
        """Each bucket's plan by (form and layout, slot address): one per slot it is packed
        into."""

    def publish(
        self,
        publisher: Publisher,
        tensors: Mapping[str, torch.Tensor],
        version: int,
        *,
        wait: bool = False,
        timeout_s: float = 600.0,
    ) -> PublishResult:
        """Publish ``tensors`` (on one device) as ``version`` through ``publisher``, as
        ``publisher.publish(self.fp8(tensors), version, ...)`` would, with the weights
        quantized bucket by bucket. Returns and raises as ``Publisher.publish``.

        Raises:
            ConfigError: ``publisher`` is one rank of several; no tensors, or tensors on more
                than one device (names one on each).
            ValueError: ``fp8.quantized`` picked a tensor that is not a 2-D float weight.
        """
        if publisher.world_size != 1:
            raise ConfigError(
                f"Fp8Packs.publish: publisher rank {publisher.rank} of {publisher.world_size}; "
                "it publishes one process's whole model (Megatron ranks: "
                "MegatronPublisher(..., fp8=BlockFp8()) quantizes each rank's shards)"
            )
        form = self._form_of(tensors)
        device = next(iter(tensors.values())).device
        whole: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """This version's weights quantized whole (those split between buckets)."""

        def pack(bucket: Bucket, buffer: torch.Tensor) -> None:
            self._pack(bucket, buffer, tensors, form, whole)

        return publisher.publish_packed(
            form.manifest.at(version), pack, device=device, wait=wait, timeout_s=timeout_s
        )

    def _form_of(self, tensors: Mapping[str, torch.Tensor]) -> _Form:
        """The last form while ``tensors`` hold what they held, else a new one."""
        form = self._form
        if form is not None and self._same is not None and self._same.holds(tensors):
            return form
        key = layout_key(tensors)
        if form is None or form.key != key:
            form = self._form = self._new_form(tensors, key)
            self._plans.clear()
        self._same = SameTensors(tensors)
        return form

    def _new_form(self, tensors: Mapping[str, torch.Tensor], key: tuple) -> _Form:
        first_on: dict[torch.device, str] = {}
        for name, t in tensors.items():
            first_on.setdefault(t.device, name)
        if len(first_on) != 1:
            where = ", ".join(f"{n!r} on {d}" for d, n in first_on.items()) or "no tensors"
            raise ConfigError(
                f"Fp8Packs.publish: {where}; it publishes the tensors of one device (the "
                "trainer's), at least one"
            )
        specs = self.fp8.specs(TensorSpec.of(n, t) for n, t in tensors.items())
        picked = [n for n, t in tensors.items() if self.fp8.quantized(n, t)]
        weights = {**{n: n for n in picked}, **{scale_name(n): n for n in picked}}
        return _Form(key, VersionManifest(1, specs), weights)

    def _pack(
        self,
        bucket: Bucket,
        buffer: torch.Tensor,
        tensors: Mapping[str, torch.Tensor],
        form: _Form,
        whole: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        plan = self._plans.get(
            (Same(form, bucket), buffer.data_ptr()),
            lambda: _BucketPlan.of(self.fp8, bucket, buffer, tensors, form),
        )
        if plan.kernel is not None:
            plan.kernel.run()
        for name, values, scales in plan.by_torch:
            _by_torch(self.fp8, tensors[name], values, scales)
        for entry in plan.copies:
            pack_entry(buffer, entry, tensors[entry.name])
        for entry in plan.split:
            weight = form.weights[entry.name]
            if weight not in whole:
                t = tensors[weight]
                whole[weight] = out = (
                    torch.empty(t.shape, dtype=FP8, device=t.device),
                    torch.empty(scale_shape(t.shape, self.fp8.block), device=t.device),
                )
                if _kernel_fits(self.fp8, (t, *out)):
                    fp8_kernel.Quantize([(t, *out)], ue8m0=self.fp8.ue8m0).run()
                else:
                    _by_torch(self.fp8, t, *out)
            pack_entry(buffer, entry, whole[weight][0 if entry.name == weight else 1])


MAX_PLANS = 1024
"""Bucket plans kept (a bucket's per slot it was packed into): more than a model's buckets
times the sender's slots, for any bucket size but the smallest."""


@dataclass(frozen=True)
class _BucketPlan:
    """How one bucket is packed into one slot, worked out once per form and layout: with
    thousands of experts, finding each entry's place every version cost more than packing."""

    kernel: fp8_kernel.Quantize | None
    """The weights whose values and scales both lie whole in the bucket and the kernel
    fits, quantized into it in one launch."""
    by_torch: tuple[tuple[str, torch.Tensor, torch.Tensor], ...]
    """The other such weights (name, its values and scales in the bucket): torch's ops."""
    copies: tuple[BucketEntry, ...]
    """Tensors not quantized, copied as they are."""
    split: tuple[BucketEntry, ...]
    """Values or scales of a weight whose other half or other chunks lie elsewhere: the
    weight quantized whole (once per version), the entry copied from that."""

    @classmethod
    def of(
        cls,
        fp8: BlockFp8,
        bucket: Bucket,
        buffer: torch.Tensor,
        tensors: Mapping[str, torch.Tensor],
        form: _Form,
    ) -> _BucketPlan:
        here = {e.name: e for e in bucket.entries if _whole(e)}
        fit: list[fp8_kernel.Job] = []
        by_torch, copies, split = [], [], []
        for entry in bucket.entries:
            weight = form.weights.get(entry.name)
            if weight is None:
                copies.append(entry)
                continue
            values, scales = here.get(weight), here.get(scale_name(weight))
            if values is None or scales is None:
                split.append(entry)
            elif entry is values:
                job = (tensors[weight], entry_view(buffer, values), entry_view(buffer, scales))
                if _kernel_fits(fp8, job):
                    fit.append(job)
                else:
                    by_torch.append((weight, *job[1:]))
        kernel = fp8_kernel.Quantize(fit, ue8m0=fp8.ue8m0) if fit else None
        return cls(kernel, tuple(by_torch), tuple(copies), tuple(split))


def _whole(entry: BucketEntry) -> bool:
    return not entry.is_chunked and not entry.box_start


def _kernel_fits(fp8: BlockFp8, job: fp8_kernel.Job) -> bool:
    """Whether the block FP8 kernel quantizes ``job`` as ``fp8`` would (its block is the
    kernel's tile)."""
    return fp8.block == (fp8_kernel.TILE, fp8_kernel.TILE) and fp8_kernel.fits(*job)


@torch.no_grad()
def _by_torch(
    fp8: BlockFp8, weight: torch.Tensor, values: torch.Tensor, scales: torch.Tensor
) -> None:
    """``weight`` quantized as ``fp8`` does, with torch's ops, into ``values`` and ``scales``."""
    v, s = quantize_block_fp8(weight, fp8.block, ue8m0=fp8.ue8m0)
    values.copy_(v)
    scales.copy_(s)
