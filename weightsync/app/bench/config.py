"""A bench run's settings: :class:`BenchConfig` (from ``weightsync bench``'s options) and the
weightsync cases it can measure (:data:`CASES`), checked when built."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.app.bench.models import MODELS
from weightsync.buckets import DEFAULT_BUCKET_SIZE_BYTES
from weightsync.errors import ConfigError

CASES = ("staged", "direct", "ipc-cross", "nccl")


@dataclass(frozen=True)
class BenchConfig:
    model: str = "qwen2.5-7b"
    layers: int | None = None
    """Cut the model to this many layers (default: all, or what fits for the MoE model)."""
    tps: tuple[int, ...] = (1, 2)
    cases: tuple[str, ...] = CASES
    device: str = "auto"
    """auto (cuda:0 when available), cuda, or cpu (shm instead of cuda_ipc)."""
    versions: int = 5
    """Measured versions per case; the median is reported."""
    warmup: int = 1
    """Versions before measuring (version 1 opens IPC handles and resolves names)."""
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    baselines: bool = True
    floors: bool = True
    sender_process: bool = False
    """The one-GPU cases' sender in a process of its own (``_sender``)."""
    seed: int = 0
    timeout_s: float = 300.0
    gpus: int = 0
    """With N >= 1: also the node case on GPUs 0..N-1 (``node.py``)."""
    engine_tp: int = 1
    """The node case's engine TP size (``gpus`` a multiple of it)."""
    trainer_tps: tuple[int, ...] = (1,)
    """The node case's trainer TP sizes, one node run each (``gpus`` a multiple of each)."""
    megatron: bool = False
    """The node case also with a real megatron-core trainer per layout (``megatron_node.py``)."""
    megatron_ep: int = 2
    """Its expert-parallel size for MoE models (``gpus`` and the experts multiples of it;
    dense models ignore it)."""
    hosts: int = 0
    """With N >= 1: also the hosts case on N GPUs as two hosts (``hosts.py``; CPU: two
    receivers)."""
    fanout: int = 0
    """With N >= 2: also the NCCL fan-out case, GPU 0 to a receiver on each of GPUs 0..N-1,
    against one broadcast of the same bytes (``fanout.py``)."""
    fp8: bool = False
    """Also the model's versions in block FP8 against bf16, bytes and time (``fp8.py``)."""
    deltas: bool = False
    """Also one layer's Adam steps broadcast to another host in full and as exact deltas,
    bytes and time (``broadcast_deltas.py``)."""

    def __post_init__(self) -> None:
        unknown = set(self.cases) - set(CASES)
        if unknown:
            raise ConfigError(f"unknown case(s) {sorted(unknown)}; known: {', '.join(CASES)}")
        if self.versions < 1 or self.warmup < 0:
            raise ConfigError("--versions must be >= 1 and --warmup >= 0")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"--device {self.device!r}: pick auto, cuda or cpu")
        if self.gpus < 0:
            raise ConfigError(f"--gpus {self.gpus}: give a number of GPUs, or 0 for no node case")
        if self.engine_tp < 1 or (self.gpus and self.gpus % self.engine_tp):
            raise ConfigError(
                f"--engine-tp {self.engine_tp}: give a TP size that divides --gpus {self.gpus}"
            )
        bad = [tp for tp in self.trainer_tps if tp < 1 or (self.gpus and self.gpus % tp)]
        if bad or not self.trainer_tps:
            raise ConfigError(
                f"--trainer-tp {bad[0] if bad else '(none)'}: give TP sizes that divide "
                f"--gpus {self.gpus}"
            )
        if self.megatron and not self.gpus:
            raise ConfigError("--megatron is the node case's: give --gpus N too")
        shape = MODELS.get(self.model)
        moe = shape is not None and shape.is_moe  # dense models have no experts to spread
        if self.megatron_ep < 1 or (moe and self.gpus and self.gpus % self.megatron_ep):
            raise ConfigError(
                f"--megatron-ep {self.megatron_ep}: give an EP size that divides --gpus {self.gpus}"
            )
        if self.fanout < 0 or self.fanout == 1:
            raise ConfigError(f"--fanout {self.fanout}: give 2 or more GPUs, or 0 for none")
        if self.hosts and self.hosts % self.engine_tp:
            raise ConfigError(
                f"--engine-tp {self.engine_tp}: give a TP size that divides --hosts {self.hosts}"
            )
