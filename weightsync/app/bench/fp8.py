"""The FP8 rows of ``weightsync bench --fp8`` (issue 36): the same model published as bf16 and
as block FP8 (``weightsync.fp8.BlockFp8``: e4m3 projections and their 128 x 128 float32
``weight_scale_inv``, everything else bf16), bytes on the wire and time, in one run.

The trainer (this process) holds the model's bf16 HF tensors on the device, filled with
normal values from each version's seed; a ``TorchReceiver`` process on the same device holds a
plain module of the version's tensors (bf16, or the FP8 checkpoint form), views of one buffer
as an engine keeps fused experts in a few tensors: on the sender's GPU the sender writes them
in place for MoE shapes too (thousands of separate storages are more than a write offer may
name); on another GPU (``--receiver-device``) the receiver reads the buckets. Each version is one
``publish(wait=True)`` (start -> applied); the FP8 row's time includes quantizing every
version on the trainer's device. A third row, ``fp8 ready``, publishes the same FP8 versions
with ``ready=fp8.ready``: the version begins as the quantization is queued, and the sender
packs each bucket once the launches that write its weights have finished. A fourth, ``fp8
packed``, publishes them through ``Fp8Packs``: no quantization first, each bucket's weights
quantized into it as the sender asks the trainer to pack it. Every version is checked bit for
bit on the receiver, which makes the expected tensors itself from the seed (and quantizes them
with the same code), before the next is published, so the check is not timed.

Target (issue 36): FP8 bytes at most 0.51x bf16; time at most 1.15x the bf16 time scaled by the
byte ratio.

Run alone: ``python -m weightsync.app.bench.fp8`` (prints one JSON line).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from weightsync.app.arguments import bench_alone_parser
from weightsync.app.bench.children import children, expect, reporting, scratch_dir
from weightsync.app.bench.fanout import _module, _offsets, _views
from weightsync.app.bench.models import ModelShape, hf_specs, model_shape
from weightsync.buckets import TensorSpec
from weightsync.fp8 import FP8, BlockFp8, scale_name

BYTES_TARGET, TIME_TARGET = 0.51, 1.15


@dataclass(frozen=True)
class Fp8Run:
    """One bf16 and one FP8 measurement of the same model."""

    device: str
    bf16_bytes: int
    fp8_bytes: int
    bf16_s: tuple[float, ...]
    fp8_s: tuple[float, ...]
    bit_exact: bool
    quantize_s: tuple[float, ...] = ()
    """The trainer's quantization alone, every tensor once per sample (part of ``fp8_s``)."""
    packed_s: tuple[float, ...] = ()
    """The FP8 versions quantized bucket by bucket in the publisher's pack (``Fp8Packs``)."""
    ready_s: tuple[float, ...] = ()
    """The FP8 versions begun while quantized (``publish(..., ready=fp8.ready)``)."""
    weights_ratio: float = 0.0
    """The quantized weights' FP8 bytes (values and scales) over their bf16 bytes: the rest
    (embeddings, LM head, norms) stays bf16, as the engines' FP8 checkpoints hold it."""

    @property
    def byte_ratio(self) -> float:
        return self.fp8_bytes / self.bf16_bytes

    @property
    def time_ratio(self) -> float:
        """FP8 time over the bf16 time scaled by the byte ratio (target <= 1.15)."""
        return self._ratio(self.fp8_s)

    @property
    def packed_ratio(self) -> float:
        """The same ratio for the FP8 versions quantized in the pack."""
        return self._ratio(self.packed_s)

    @property
    def ready_ratio(self) -> float:
        """The same ratio for the FP8 versions begun while quantized."""
        return self._ratio(self.ready_s)

    def _ratio(self, samples: tuple[float, ...]) -> float:
        return statistics.median(samples) / (statistics.median(self.bf16_s) * self.byte_ratio)

    def rows(self) -> list:
        from weightsync.app.bench.report import WEIGHTSYNC, Row

        def row(name: str, nbytes: int, samples: tuple[float, ...], note: str = ""):
            return Row(
                WEIGHTSYNC, name, "auto", "TP=1", self.device, nbytes, samples,
                bit_exact=self.bit_exact, note=note, failed=not self.bit_exact,
            )  # fmt: skip

        note = (
            f"bytes {self.byte_ratio:.3f}x bf16 (target <= {BYTES_TARGET}; the quantized "
            f"weights {self.weights_ratio:.3f}x, the rest stays bf16 as FP8 checkpoints hold "
            f"it); time {self.time_ratio:.2f}x bf16 scaled by bytes (target <= {TIME_TARGET})"
        )
        rows = [
            row("bf16", self.bf16_bytes, self.bf16_s),
            row("fp8", self.fp8_bytes, self.fp8_s, note),
        ]
        if self.quantize_s:
            rows.append(row("fp8 quantize alone", self.bf16_bytes, self.quantize_s))
        for name, samples in (("fp8 ready", self.ready_s), ("fp8 packed", self.packed_s)):
            if samples:
                ratio = self._ratio(samples)
                note = f"time {ratio:.2f}x bf16 scaled by bytes (target <= {TIME_TARGET})"
                rows.append(row(name, self.fp8_bytes, samples, note))
        return rows


def _fill(views: Mapping[str, torch.Tensor], version: int) -> None:
    """Weights of a trained model's scale, the same for the same version on one device kind."""
    g = torch.Generator(next(iter(views.values())).device).manual_seed(version)
    for t in views.values():
        t.normal_(0.0, 0.02, generator=g)


def _receiver(specs, quantize: bool, device: str, address: str, versions, timeout_s, out):
    from weightsync.receiver.torch_receiver import TorchReceiver

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    received = _received_specs(specs, quantize)
    model = _module(received, dev, flat=True)
    live = dict(model.state_dict())
    offsets, total = _offsets(specs)
    expected = _views(torch.empty(total, dtype=torch.uint8, device=dev), specs, offsets)
    fp8 = BlockFp8()
    receiver = TorchReceiver(model, address, receiver_id="fp8" if quantize else "bf16")
    out.put(("ready", 0))
    try:
        for _ in range(versions):
            version = receiver.sync(timeout=timeout_s)
            _fill(expected, version)
            want = fp8(expected) if quantize else expected
            wrong = [n for n, t in want.items() if not _same_bytes(live[n], t)]
            why = f"version {version}: {len(wrong)} differ, first {wrong[:3]}" if wrong else ""
            out.put(("applied", 0, why))
    finally:
        receiver.close()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _received_specs(specs, quantize: bool) -> list[TensorSpec]:
    """What the receiver holds: the HF tensors, or their FP8 checkpoint form."""
    return list(BlockFp8().specs(specs) if quantize else specs)


def _measure(
    specs, form: str, device: torch.device, versions: int, warmup: int, timeout_s: float,
    settings: dict, receiver_device: torch.device,
) -> tuple[tuple[float, ...], int, list[str], tuple[float, ...]]:  # fmt: skip
    """``form``: ``bf16``, ``fp8`` (quantized, then published), ``fp8 ready`` or ``fp8
    packed``."""
    from weightsync.sender import Publisher, Sender
    from weightsync.sender.fp8_packs import Fp8Packs

    offsets, total = _offsets(specs)
    views = _views(torch.empty(total, dtype=torch.uint8, device=device), specs, offsets)
    quantize = form != "bf16"
    fp8 = BlockFp8()
    packs = Fp8Packs(fp8) if form == "fp8 packed" else None
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    samples, wrong, nbytes = [], [], 0
    with scratch_dir("ws-fp8-") as sock_dir:
        with (
            Sender(f"unix:{sock_dir}/s.sock", ack_timeout_s=timeout_s, **settings) as sender,
            children() as procs,
        ):
            args = (
                specs, quantize, str(receiver_device), sender.address, warmup + versions,
                timeout_s, out,
            )  # fmt: skip
            procs.append(ctx.Process(target=reporting, args=("receiver", _receiver, *args)))
            procs[-1].start()
            expect(out, procs, "ready", 1, timeout_s, "fp8 bench")
            with Publisher(sender.address) as publisher:
                for version in range(1, warmup + versions + 1):
                    _fill(views, version)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    start = time.perf_counter()
                    if packs is not None:
                        result = packs.publish(
                            publisher, views, version, wait=True, timeout_s=timeout_s
                        )
                    else:
                        tensors = fp8(views) if quantize else views
                        ready = fp8.ready if form == "fp8 ready" else None
                        result = publisher.publish(
                            tensors, version, wait=True, timeout_s=timeout_s, ready=ready
                        )
                    samples.append(time.perf_counter() - start)
                    nbytes = result.status.total_bytes
                    got = expect(out, procs, "applied", 1, timeout_s, "fp8 bench")
                    wrong += [why for _, _, why in got if why]
    quantize_s = tuple(_quantize_alone(fp8, views, versions)) if form == "fp8" else ()
    return tuple(samples[warmup:]), nbytes, wrong, quantize_s


def _quantize_alone(fp8: BlockFp8, views, times: int):
    """Each of ``times`` quantizations of every tensor, alone (after the versions)."""
    device = next(iter(views.values())).device
    for _ in range(times):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fp8(views)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        yield time.perf_counter() - start


def measure_fp8(
    shape: ModelShape,
    device: torch.device,
    versions: int,
    warmup: int,
    timeout_s: float,
    bucket_size_bytes: int | None = None,
    receiver_device: torch.device | None = None,
) -> Fp8Run:
    """Publish ``warmup`` + ``versions`` versions of ``shape`` in bf16, then as many in block
    FP8 quantized first, begun while quantized, and quantized in the pack, from ``device`` to
    a receiver on
    ``receiver_device`` (default: the same device; on another GPU the bytes cross a link, where
    fewer of them pay); the measured ones' times and the bytes of each."""
    specs = hf_specs(shape)
    settings = {} if bucket_size_bytes is None else {"bucket_size_bytes": bucket_size_bytes}
    to = device if receiver_device is None else receiver_device
    runs = {
        form: _measure(specs, form, device, versions, warmup, timeout_s, settings, to)
        for form in ("bf16", "fp8", "fp8 ready", "fp8 packed")
    }
    wrong = [line for _, _, lines, _ in runs.values() for line in lines]
    for line in wrong:
        print(f"fp8 bench: NOT bit-exact: {line}", flush=True)
    (bf16_s, bf16_bytes, _, _), (fp8_s, fp8_bytes, _, quantize_s) = runs["bf16"], runs["fp8"]
    where = str(device) if to == device else f"{device} -> {to}"
    return Fp8Run(
        where, bf16_bytes, fp8_bytes, bf16_s, fp8_s, not wrong, quantize_s,
        packed_s=runs["fp8 packed"][0], ready_s=runs["fp8 ready"][0],
        weights_ratio=_weights_ratio(specs),
    )  # fmt: skip


def _weights_ratio(specs) -> float:
    """:attr:`Fp8Run.weights_ratio` of the model of ``specs``."""
    fp8 = {s.name: s for s in BlockFp8().specs(specs)}
    picked = [s for s in specs if fp8[s.name].torch_dtype == FP8]
    quantized = sum(fp8[s.name].nbytes + fp8[scale_name(s.name)].nbytes for s in picked)
    return quantized / max(1, sum(s.nbytes for s in picked))


def summary(run: Fp8Run) -> str:
    """One line: bytes and time of FP8 against bf16, and the targets."""
    bf16, fp8 = statistics.median(run.bf16_s), statistics.median(run.fp8_s)
    return (
        f"bf16 {run.bf16_bytes / 1e9:.2f} GB in {bf16 * 1e3:.1f} ms; fp8 {run.fp8_bytes / 1e9:.2f} "
        f"GB in {fp8 * 1e3:.1f} ms (quantizing included; alone "
        f"{statistics.median(run.quantize_s) * 1e3:.1f} ms): bytes {run.byte_ratio:.3f}x (target "
        f"<= {BYTES_TARGET}; the quantized weights {run.weights_ratio:.3f}x), time "
        f"{run.time_ratio:.2f}x the bf16 time scaled by bytes (target "
        f"<= {TIME_TARGET}); begun while quantized {statistics.median(run.ready_s) * 1e3:.1f} "
        f"ms, {run.ready_ratio:.2f}x; quantized in the pack "
        f"{statistics.median(run.packed_s) * 1e3:.1f} ms, {run.packed_ratio:.2f}x; bit-exact "
        f"{run.bit_exact}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = bench_alone_parser(__doc__)
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--versions", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--receiver-device",
        default=None,
        help="where the receiver runs (default: --device); another GPU puts a link in the way",
    )
    p.add_argument("--bucket-size-mb", type=int, default=None)
    p.add_argument("--timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    bucket = args.bucket_size_mb * 1024 * 1024 if args.bucket_size_mb else None
    run = measure_fp8(
        model_shape(args.model, args.layers),
        torch.device(args.device),
        args.versions,
        args.warmup,
        args.timeout_s,
        bucket,
        torch.device(args.receiver_device) if args.receiver_device else None,
    )
    print(summary(run), flush=True)
    ratios = {"byte_ratio": run.byte_ratio, "time_ratio": run.time_ratio}
    more = {"packed_ratio": run.packed_ratio, "ready_ratio": run.ready_ratio}
    print(json.dumps({**asdict(run), **ratios, **more}))
    return 0 if run.bit_exact else 1


if __name__ == "__main__":
    sys.exit(main())
