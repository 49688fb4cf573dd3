"""Where a version's passes over the bytes go on the shm path (issue 31 part 4), on CPU.

A trainer offers its tensors in shm (``shm_tensors``), so the sender maps them and packs every
bucket itself; a receiver process loads them into plain tensors (an :class:`InPlaceTarget`,
as ``TorchReceiver``'s). Per version: the end to end ``publish(wait=True)``, and the sums over
its buckets of the sender's pack (its copies and the check of what they wrote), the sender's
checksum when the pack did not take it, the receiver's loads, and its checksum when the loads
did not take it; beside one ``copy_`` of the same bytes as one flat buffer. Run it before and
after a change in the same way::

    python -m weightsync.app.bench.shm_passes --model qwen3-dense-cpu --versions 8 [--old]

``--old``: the passes as before the blocked copies (issue 31 part 4): copies, then the pack's
check and the checksums as reads of their own, in the same code and run.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from weightsync.app.arguments import bench_alone_parser

PHASES = ("pack", "pack_check", "sender_checksum", "receiver_load", "receiver_checksum")


class Timers:
    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    @contextmanager
    def timed(self, phase: str):
        began = time.perf_counter()
        try:
            yield
        finally:
            self.spent[phase] += time.perf_counter() - began

    def wrap(self, owner, name: str, phase: str) -> None:
        """Time every call of ``owner.name`` into ``phase``."""
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            with self.timed(phase):
                return real(*args, **kwargs)

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out, self.spent = dict(self.spent), defaultdict(float)
        return out


def old_passes() -> None:
    """No blocked copies: copy, check and checksum in passes of their own, as before."""
    from weightsync.blocked_copies import BlockedCopies

    BlockedCopies.plan = classmethod(lambda cls, *args, **kwargs: None)


def _receiver_main(address: str, specs, versions: int, out, old: bool) -> None:
    if old:
        old_passes()
    from weightsync.receiver.core import ReceiverCore
    from weightsync.receiver.reader import VersionReads
    from weightsync.receiver.target import InPlaceTarget

    timers = Timers()
    live = {s.name: torch.empty(s.shape, dtype=s.torch_dtype) for s in specs}

    class Target(InPlaceTarget):
        device = torch.device("cpu")

        def validate(self, manifest) -> None:
            self.check_shapes(manifest)

        def live_tensor(self, name: str) -> torch.Tensor:
            return live[name]

    timers.wrap(Target, "load", "receiver_load")
    timers.wrap(VersionReads, "checksum", "receiver_checksum")
    receiver = ReceiverCore(Target(), address, receiver_id="bench", engine="torch")
    out.put("registered")
    per_version = []
    try:
        for _ in range(versions):
            receiver.sync(timeout=600)
            per_version.append(timers.take())
        out.put((per_version, {n: int(t.view(torch.int16).sum()) for n, t in live.items()}))
    except Exception as e:  # the parent reports it
        out.put(f"{type(e).__name__}: {e}")
    finally:
        receiver.close()


def run(
    model: str, versions: int, warmup: int, bucket_size_mb: float, old: bool = False
) -> dict[str, object]:
    import weightsync.sender.packing as packing
    import weightsync.sender.version as version_module
    from weightsync.app.bench.engine import random_weights
    from weightsync.app.bench.models import MODELS
    from weightsync.buckets import TensorSpec
    from weightsync.sender import Publisher
    from weightsync.sender.daemon import Sender
    from weightsync.sender.driver import VersionDriver
    from weightsync.transports import get_transport, shm_tensors

    if old:
        old_passes()
    weights = random_weights(MODELS[model], 1)
    specs = [TensorSpec.of(n, t) for n, t in weights.items()]
    total = sum(t.nbytes for t in weights.values())
    store, tensors = shm_tensors(specs)
    for name, t in weights.items():
        tensors[name].copy_(t)
    del weights
    timers = Timers()
    timers.wrap(version_module, "pack_bucket", "pack")
    if hasattr(packing, "verify_copies"):
        timers.wrap(packing, "verify_copies", "pack_check")
    timers.wrap(VersionDriver, "packed", "sender_checksum")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rows = []
    root = tempfile.mkdtemp(prefix="ws-shm-passes-")
    try:
        with Sender(f"unix:{root}/s.sock", bucket_size_bytes=int(bucket_size_mb * 2**20)) as s:
            proc = ctx.Process(
                target=_receiver_main, args=(s.address, specs, warmup + versions, out, old)
            )
            proc.start()
            if (hello := out.get(timeout=600)) != "registered":
                raise RuntimeError(f"receiver: {hello}")
            with Publisher(s.address) as publisher:
                for v in range(1, warmup + versions + 1):
                    for t in tensors.values():
                        t.view(torch.int16).bitwise_xor_(1)
                    timers.take()
                    began = time.perf_counter()
                    status = publisher.publish(tensors, v, wait=True, timeout_s=600).status
                    took = time.perf_counter() - began
                    rows.append({"end_to_end": took, **timers.take()})
                    if not status.sender_packed:
                        raise RuntimeError("the publisher packed: the sender did not map its shm")
            reply = out.get(timeout=600)
            proc.join(60)
        if isinstance(reply, str):
            raise RuntimeError(f"receiver: {reply}")
        received, digests = reply
        exact = digests == {n: int(t.view(torch.int16).sum()) for n, t in tensors.items()}
    finally:
        get_transport("shm").release(store)
    for row, rec in zip(rows, received, strict=True):
        row.update(rec)
    src, dst = torch.empty(total, dtype=torch.uint8), torch.empty(total, dtype=torch.uint8)
    src.fill_(1)
    copies = []
    for _ in range(max(versions, 5)):
        began = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - began)
    memcpy = statistics.median(copies)
    measured = rows[warmup:]
    med = {k: statistics.median(r.get(k, 0.0) for r in measured) for k in ("end_to_end", *PHASES)}
    return {
        "model": model,
        "passes": "old" if old else "blocked",
        "tensors": len(specs),
        "bytes": total,
        "versions": versions,
        "bit_exact": exact,
        "memcpy_s": memcpy,
        "median_s": med,
        "x_memcpy": {k: v / memcpy for k, v in med.items()},
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = bench_alone_parser(__doc__)
    parser.add_argument("--model", default="qwen3-dense-cpu")
    parser.add_argument("--versions", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-size-mb", type=float, default=512)
    parser.add_argument("--old", action="store_true", help="the passes as before")
    args = parser.parse_args(argv)
    result = run(args.model, args.versions, args.warmup, args.bucket_size_mb, args.old)
    print(json.dumps(result, indent=1))
    print(f"{'phase':<18} {'ms':>8} {'x memcpy':>9}")
    print(f"{'memcpy':<18} {result['memcpy_s'] * 1e3:8.1f}")
    for k, v in result["median_s"].items():
        print(f"{k:<18} {v * 1e3:8.1f} {result['x_memcpy'][k]:9.2f}")


if __name__ == "__main__":
    main()
