"""The delta rows of issue 36: how many bytes a version costs as exact deltas
(``weightsync.deltas``) beside its full bytes, on a realistic update and at synthetic sparsities.

Realistic: the trainer's float32 master weights of one decoder layer of the model's shape
(projections ~ N(0, 0.02), norms 1 + N(0, 0.02), biases ~ N(0, 0.02)) take Adam steps
(``torch.optim.Adam``, lr 1e-6, betas (0.9, 0.999), eps 1e-8) on gradients ~ N(0, 1e-3); each
version is the masters cast to bf16, packed into buckets as the sender plans them, and each
bucket is encoded from the previous version's. Two steps are measured: the first (fresh
optimizer state, so every weight moves by about lr: Adam's largest move at that lr) and one
after ``--warmup-steps`` steps (noise gradients leave ``m / sqrt(v)`` below 1, so weights move
less). Synthetic: one bf16 bucket with a fraction of its values moved by one bf16 step at
random places, and with whole rows moved (clustered, where the XOR form wins).

With ``--fp8`` the same Adam versions are also measured in an FP8 engine's checkpoint form
(each projection quantized to e4m3 with its 128 x 128 float32 scales as a trainer's publisher
does, :class:`weightsync.fp8.BlockFp8`, bit for bit the engines' reference quantizer; norms and
biases stay bf16): how sparse an FP8 version's change is, which ``weightsync plan
--delta-ratio`` takes for FP8 engines.

Every delta is decoded onto the previous bytes and checked bit for bit. Times are this
machine's, for encoding and decoding on ``--device`` (``cuda``: the GPU scan); the wire is not
involved (``broadcast_deltas`` measures it).

Run alone: ``python -m weightsync.app.bench.deltas`` (prints the rows and one JSON line).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from weightsync.app.arguments import bench_alone_parser
from weightsync.app.bench.models import ModelShape, hf_specs, model_shape
from weightsync.buckets import TensorSpec, pack_entry, plan_buckets
from weightsync.delta_wire import element_bytes
from weightsync.deltas import UNITS, decode, encode
from weightsync.fp8 import BlockFp8

LR, BETAS, EPS, GRAD_STD, WEIGHT_STD = 1e-6, (0.9, 0.999), 1e-8, 1e-3, 0.02


@dataclass(frozen=True)
class DeltaRow:
    """One version (or synthetic bucket) as deltas beside its full bytes."""

    case: str
    full_bytes: int
    delta_bytes: int
    changed: float
    """Fraction of the elements that differ from the previous version (elements of the size
    the codec compares in each bucket: bf16 values, or e4m3 ones in an FP8 bucket)."""
    kinds: dict[str, int]
    """Buckets per chosen form."""
    encode_s: float
    decode_s: float
    bit_exact: bool

    @property
    def ratio(self) -> float:
        return self.delta_bytes / self.full_bytes


def layer_specs(shape: ModelShape) -> list[TensorSpec]:
    """The tensors of decoder layer 0 of ``shape``."""
    return [s for s in hf_specs(shape.with_layers(1)) if s.name.startswith("model.layers.0.")]


def adam_versions(
    specs: Sequence[TensorSpec], warmup_steps: int, device: torch.device, seed: int = 0
) -> dict[str, list[torch.Tensor]]:
    """Each tensor's bf16 versions: before and after the first Adam step, then before and
    after step ``warmup_steps + 1`` (one tensor at a time, to bound memory)."""
    g = torch.Generator(device).manual_seed(seed)
    out: dict[str, list[torch.Tensor]] = {}
    for spec in specs:
        master = torch.randn(spec.shape, generator=g, device=device) * WEIGHT_STD
        if spec.name.endswith("norm.weight"):
            master += 1.0
        param = torch.nn.Parameter(master)
        opt = torch.optim.Adam([param], lr=LR, betas=BETAS, eps=EPS)
        versions = []
        for step in range(warmup_steps + 1):
            if step in (0, warmup_steps):
                versions.append(param.detach().bfloat16())
            param.grad = torch.randn(spec.shape, generator=g, device=device) * GRAD_STD
            opt.step()
            if step in (0, warmup_steps):
                versions.append(param.detach().bfloat16())
        out[spec.name] = versions
        del param, opt
    return out


def measure(
    case: str,
    specs: Sequence[TensorSpec],
    previous: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    bucket_bytes: int,
) -> DeltaRow:
    """Pack both versions into the sender's buckets, encode each bucket from the previous
    version's, decode it back and check it."""
    device = next(iter(new.values())).device
    old_buf = torch.zeros(bucket_bytes, dtype=torch.uint8, device=device)
    new_buf = torch.zeros_like(old_buf)
    full = delta = changed = elements = 0
    kinds: Counter[str] = Counter()
    encode_s = decode_s = 0.0
    exact = True
    for bucket in plan_buckets(specs, bucket_bytes).buckets:
        for buffer, tensors in ((old_buf, previous), (new_buf, new)):
            for entry in bucket.entries:
                pack_entry(buffer, entry, tensors[entry.name])
            bucket.zero_gaps(buffer)  # as the sender packs: the bytes are the tensors' alone
        n, name = bucket.nbytes, f"bucket {bucket.index}"
        units: Counter[int] = Counter()
        for entry in bucket.entries:
            units[entry.spec.torch_dtype.itemsize] += entry.nbytes
        unit = element_bytes(units)  # as the sender's bases choose it
        _settle(device)
        start = time.perf_counter()
        d = encode(old_buf[:n], new_buf[:n], base_version=1, bucket=name, element_bytes=unit)
        _settle(device)
        encode_s += time.perf_counter() - start
        held = old_buf[:n].clone()
        _settle(device)
        start = time.perf_counter()
        decode(d, held, base_version=1, base_checksum=d.base_checksum)
        _settle(device)
        decode_s += time.perf_counter() - start
        exact &= torch.equal(held, new_buf[:n])
        full, delta, kinds[d.kind] = full + n, delta + d.payload_bytes, kinds[d.kind] + 1
        word = UNITS[unit]
        changed += int((old_buf[:n].view(word) != new_buf[:n].view(word)).sum())
        elements += n // unit
    return DeltaRow(case, full, delta, changed / elements, dict(kinds), encode_s, decode_s, exact)


def fp8_form(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` as an FP8 engine's checkpoint holds them, quantized as a trainer's
    publisher does (:class:`~weightsync.fp8.BlockFp8`, a new one per call: its results are
    views it reuses)."""
    return BlockFp8()(tensors)


def _settle(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA ops return before they ran)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic(
    fraction: float, clustered: bool, elements: int, cols: int, device: torch.device
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One bf16 matrix and the same with ``fraction`` of its values (or of its rows, whole)
    moved by one bf16 step."""
    g = torch.Generator(device).manual_seed(1)
    before = (
        torch.randn(elements // cols, cols, generator=g, device=device) * WEIGHT_STD
    ).bfloat16()
    after = before.clone()
    moved = after.view(torch.int16) if clustered else after.view(torch.int16).view(-1)
    count = moved.shape[0]
    moved[torch.randperm(count, generator=g, device=device)[: round(fraction * count)]] += 1
    return {"w": before}, {"w": after}


def run(args: argparse.Namespace) -> list[DeltaRow]:
    device = torch.device(args.device)
    shape = model_shape(args.model, 1)
    specs = layer_specs(shape)
    bucket = args.bucket_size_mb << 20
    versions = adam_versions(specs, args.warmup_steps, device)
    forms = [("", specs, lambda tensors: tensors)]
    if args.fp8:
        forms.append(("FP8 ", list(BlockFp8().specs(specs)), fp8_form))
    if device.type == "cuda":  # untimed: the process's first kernels and allocations
        first = {n: v[0] for n, v in versions.items()}
        measure("warm-up", specs, first, {n: v[1] for n, v in versions.items()}, bucket)
    rows = [
        measure(
            f"{form}{shape.name} layer, Adam step {1 if i == 0 else args.warmup_steps + 1} at "
            f"lr {LR:g}",
            form_specs,
            convert({n: v[i] for n, v in versions.items()}),
            convert({n: v[i + 1] for n, v in versions.items()}),
            bucket,
        )
        for form, form_specs, convert in forms
        for i in (0, 2)
    ]
    del versions
    cols = shape.hidden
    elements = (args.synthetic_mb << 20) // 2 // cols * cols
    spec = [TensorSpec("w", "bfloat16", (elements // cols, cols))]
    for fraction in args.sparsities:
        for clustered in (False, True):
            before, after = synthetic(fraction, clustered, elements, cols, device)
            how = "whole rows" if clustered else "scattered"
            rows.append(measure(f"synthetic {fraction:g} {how}", spec, before, after, bucket))
    return rows


def summary(row: DeltaRow) -> str:
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(row.kinds.items()))
    return (
        f"{row.case}: {row.changed:.2%} of values changed; {row.full_bytes / 1e6:.1f} MB full, "
        f"{row.delta_bytes / 1e6:.2f} MB as deltas ({row.ratio:.4f}x; buckets: {kinds}); "
        f"encode {row.encode_s * 1e3:.1f} ms, decode {row.decode_s * 1e3:.1f} ms; bit-exact "
        f"{row.bit_exact}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = bench_alone_parser(__doc__)
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--bucket-size-mb", type=int, default=128)
    p.add_argument("--synthetic-mb", type=int, default=64)
    p.add_argument("--sparsities", type=float, nargs="*", default=[0.001, 0.01, 0.03, 0.1, 0.3])
    p.add_argument(
        "--fp8",
        action="store_true",
        help="also the Adam steps in an FP8 engine's checkpoint form (e4m3, 128 x 128 scales)",
    )
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = run(args)
    for row in rows:
        print(summary(row), flush=True)
    print(json.dumps([{**asdict(r), "ratio": r.ratio} for r in rows]))
    return 0 if all(r.bit_exact for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
