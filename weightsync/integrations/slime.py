"""A slime weight updater over weightsync: Megatron ranks publish, SGLang engines receive.

slime (THUDM/slime) has no setting for the weight-updater class: ``MegatronTrainRayActor.init``
(``slime/backends/megatron_utils/actor.py``, read at commit 624b824a) picks one of
``UpdateWeightFromTensor`` / ``UpdateWeightFromDistributed`` / ``UpdateWeightFromDisk`` by
name from its module globals, after calling the user's ``--custom-megatron-init-path``
function (``slime/backends/megatron_utils/initialize.py``). :func:`install` is such a
function: it rebinds those names in the actor module to :class:`WeightsyncUpdateWeight`, so
the choice that follows constructs ours. Configure::

    # trainer (slime's train.py), every rank's environment: WEIGHTSYNC_ADDRESS=<sender>
    --custom-megatron-init-path weightsync.integrations.slime.install
    # engines: slime passes --sglang-* through to SGLang; environment WEIGHTSYNC_ADDRESS too
    --sglang-custom-weight-loader weightsync.receiver.sglang.hook.sync_weights

This module imports nothing from slime: it implements the updater interface slime calls
(``__init__(args, model, weights_getter, *, model_name, quantization_config)``,
``connect_rollout_engines(rollout_engines, rollout_engine_lock, engine_gpu_counts=...,
engine_gpu_offsets=..., engine_parallel_configs=...)``, ``update_weights()``,
``weight_version``, ``pop_metrics()``, ``disconnect_rollout_engines()``) as read in that
commit; slime was not installed to test it (it needs CUDA-only packages). The test drives it
with real megatron-core ranks on CPU, a real sender and receivers behind a stand-in for
slime's engine actors (an HTTP server answering SGLang's update routes).

Per ``update_weights``: ``weight_version += 1``; rank 0 starts every engine's update
(:class:`~weightsync.drivers.sglang.SglangHttpClient`: pause, begin, the hook receives,
end, flush, version, continue) and, while engines' workers are not yet registered (SGLang
workers register on their first update), waits until they are; then every rank publishes its
shards with :class:`~weightsync.sender.megatron.MegatronPublisher` and waits until every
receiver applied the version. Failures raise on every rank (``ReceiverFailedError``), on rank
0 also an engine's ``SglangUpdateError`` naming the step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from weightsync.drivers.sglang import PauseMode, SglangHttpClient
from weightsync.errors import ConfigError, SyncTimeoutError
from weightsync.sender.megatron import MegatronPublisher

ADDRESS_ENV = "WEIGHTSYNC_ADDRESS"
ACTOR_MODULE = "slime.backends.megatron_utils.actor"
REPLACED = ("UpdateWeightFromTensor", "UpdateWeightFromDistributed")


def install(args: Any) -> None:
    """slime's ``--custom-megatron-init-path`` hook: make the actor build our updater."""
    import importlib

    actor = importlib.import_module(ACTOR_MODULE)
    for name in REPLACED:
        setattr(actor, name, WeightsyncUpdateWeight)


def _call(engine: Any, method: str, *args: Any) -> Any:
    """``engine.method(*args)``; through Ray when ``engine`` is an actor handle."""
    fn = getattr(engine, method)
    if hasattr(fn, "remote"):
        import ray

        return ray.get(fn.remote(*args))
    return fn(*args)


class WeightsyncUpdateWeight:
    """slime's updater interface over weightsync; constructed on every trainer rank.

    Args:
        args: slime's arguments (``hf_checkpoint`` for the HF config, ``weightsync_address``
            if set, ``rollout_num_gpus_per_engine``).
        model: this rank's Megatron model chunks.
        weights_getter, model_name, quantization_config: slime's; unused (weightsync reads
            the live parameters and names them from the HF config).
        hf_config: the HF config (default: ``AutoConfig.from_pretrained(args.hf_checkpoint)``).
        address: the sender (default: ``args.weightsync_address``, else ``WEIGHTSYNC_ADDRESS``).
        timeout_s: how long one version may take.
        pause: SGLang pause mode during the update.
    """

    def __init__(
        self,
        args: Any,
        model: Sequence[torch.nn.Module],
        weights_getter: Callable[[], Mapping[str, torch.Tensor]] | None = None,
        *,
        model_name: str | None = None,
        quantization_config: Any = None,
        hf_config: Any = None,
        address: str | None = None,
        timeout_s: float = 600.0,
        pause: PauseMode | None = PauseMode.WAIT,
    ) -> None:
        import torch.distributed as dist

        address = (
            address or getattr(args, "weightsync_address", None) or os.environ.get(ADDRESS_ENV)
        )
        if not address:
            raise ConfigError(f"slime + weightsync: set {ADDRESS_ENV} in every trainer rank's env")
        if quantization_config:
            raise ConfigError("slime + weightsync: quantized rollout weights are not supported")
        if hf_config is None:
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
        self.args = args
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.timeout_s = timeout_s
        self.pause = pause
        self.weight_version = 0
        self.publisher = MegatronPublisher(list(model), hf_config, address)
        self.clients: list[SglangHttpClient] = []
        self._workers = 0
        """How many SGLang workers (TP ranks over all engines) must be registered."""
        self._metrics: dict[str, float] = {}

    def connect_rollout_engines(
        self,
        rollout_engines: Sequence[Any],
        rollout_engine_lock: Any = None,
        engine_gpu_counts: Sequence[int] | None = None,
        engine_gpu_offsets: Sequence[int] | None = None,
        engine_parallel_configs: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        if self.rank != 0:
            return
        if engine_gpu_counts is None:
            per_engine = getattr(self.args, "rollout_num_gpus_per_engine", 1)
            engine_gpu_counts = [per_engine] * len(rollout_engines)
        self.clients = [
            SglangHttpClient(_call(engine, "get_url"), tp_size=count, pause=self.pause)
            for engine, count in zip(rollout_engines, engine_gpu_counts, strict=True)
        ]
        self._workers = sum(engine_gpu_counts)

    def disconnect_rollout_engines(self) -> None:
        self.clients = []

    def pop_metrics(self) -> dict[str, float]:
        out, self._metrics = self._metrics, {}
        return out

    def _registered(self) -> int:
        status = self.publisher.publisher.status()
        return sum(1 for r in status.receivers if r.connected and r.engine == "sglang")

    def _wait_registered(self, applying: list, deadline: float) -> None:
        while self._registered() < self._workers:
            for f in applying:
                if f.done():
                    f.result()  # an engine failed before registering: raise its error
            if time.monotonic() > deadline:
                raise SyncTimeoutError(
                    f"slime + weightsync: {self._registered()} of {self._workers} SGLang workers "
                    f"registered with the sender within {self.timeout_s:.0f} s"
                )
            time.sleep(0.05)

    @torch.no_grad()
    def update_weights(self) -> None:
        import torch.distributed as dist

        self.weight_version += 1
        version = self.weight_version
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=max(1, len(self.clients))) as pool:
            applying = [pool.submit(c.update, version) for c in self.clients]
            try:
                if self.rank == 0:
                    self._wait_registered(applying, start + self.timeout_s)
                if dist.is_initialized():
                    dist.barrier()  # no rank publishes before the engines are listening
                result = self.publisher.publish(version, wait=True, timeout_s=self.timeout_s)
            finally:
                errors = [f.exception() for f in applying]
            for error in errors:
                if error is not None:
                    raise error
        self._metrics = {
            "weightsync/version": float(version),
            "weightsync/staged_s": result.staged_s,
            "weightsync/update_s": time.monotonic() - start,
        }
