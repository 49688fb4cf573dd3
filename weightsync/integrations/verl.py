"""A verl checkpoint-engine backend named ``weightsync``.

verl moves weights from the actor workers to the rollout replicas through a checkpoint engine
chosen by name in ``CheckpointEngineRegistry`` (``verl/checkpoint_engine/base.py``); a module
named in ``checkpoint_engine.custom_backend_module`` is imported on every worker first, so a
backend outside verl registers itself there. Configure::

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.address=unix:/run/weightsync/sender.sock

(or ``WEIGHTSYNC_ADDRESS`` in every worker's environment instead of ``address``), with a
``weightsync-sender`` running at that address (one per trainer job).

How verl's ``CheckpointEngineManager.update_weights`` maps onto weightsync, per step:

- ``prepare`` / ``finalize``: nothing (the sender holds the staging buffers).
- ``build_topology``: tells each worker its side (actor or rollout).
- ``init_process_group``: a rollout worker registers a receiver with the sender, once; it stays
  registered across steps, so every version reaches it.
- ``send_weights`` (every actor worker): producing the weights is collective over the actor
  group, so every worker walks the generator; actor rank 0 (``is_master``) keeps the tensors
  and publishes them as one version, returning once every receiver applied it (raises
  ``ReceiverFailedError`` naming each one that did not).
- ``receive_weights`` (every rollout worker): yields the version's tensors as buckets arrive,
  into verl's server adapter (which loads them into vLLM / SGLang by CUDA IPC or shm).

Versions: ``global_steps`` when it is greater than the last version the sender saw, else the
next integer (verl may sync twice at one step; a resumed trainer may start below a running
sender); ``send_weights`` reports the version it used in its metrics.

Memory: rank 0 holds every tensor the generator yields until the version is staged (verl's
generator gathers each full tensor on the fly; ``offload="cpu"`` copies each to CPU as it
comes, bounding device memory at one tensor plus what the generator holds).

Tested (CPU, ``tests/integration/test_integrations.py``) against verl 0.9.1 installed from
PyPI: the class subclasses verl's own ``CheckpointEngine``, is registered in its registry and
is created through ``CheckpointEngineRegistry.new`` after ``import_external_libs``, as verl's
workers do; the test drives the manager's sequence of calls (without Ray) with verl's own
``ensure_async_iterator`` on the rollout side. Not tested: inside a Ray cluster, on GPUs.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Generator
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from weightsync.errors import ConfigError
from weightsync.integrations.stream import StreamReceiver
from weightsync.sender import Publisher

BACKEND = "weightsync"
ADDRESS_ENV = "WEIGHTSYNC_ADDRESS"


def next_version(global_steps: int | None, last: int) -> int:
    """The weightsync version for verl's ``global_steps``, given the last version sent."""
    if global_steps is not None and int(global_steps) > last:
        return int(global_steps)
    return last + 1


@CheckpointEngineRegistry.register(BACKEND)
class WeightsyncCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine over a weightsync sender.

    Args:
        bucket_size: verl's ``update_weights_bucket_megabytes`` in bytes (unused: the sender's
            ``--bucket-size-mb`` decides the buckets).
        is_master: actor rank 0 (verl passes it to actor workers only); the one that publishes.
        address: the sender's ``unix:/path`` or ``host:port`` (default: ``WEIGHTSYNC_ADDRESS``).
        timeout_s: how long a version may take, publishing and receiving.
        offload: ``"cpu"``: rank 0 copies each tensor to CPU as the generator yields it
            (bounded device memory, shm staging); None keeps them where they are.
        expected_names: rollout side: reject a version with other names before any write.
        verify_checksums: rollout side: compare bucket checksums before the version completes.
    """

    def __init__(
        self,
        bucket_size: int = 0,
        is_master: bool = False,
        address: str | None = None,
        timeout_s: float = 600.0,
        offload: str | None = None,
        expected_names: list[str] | None = None,
        verify_checksums: bool = True,
    ) -> None:
        address = address or os.environ.get(ADDRESS_ENV)
        if not address:
            raise ConfigError(
                "weightsync checkpoint engine: no sender address; set checkpoint_engine."
                f"engine_kwargs.weightsync.address or {ADDRESS_ENV}"
            )
        if offload not in (None, "cpu"):
            raise ConfigError(f"offload must be None or 'cpu', got {offload!r}")
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.address = address
        self.timeout_s = timeout_s
        self.offload = offload
        self.expected_names = expected_names
        self.verify_checksums = verify_checksums
        self.role: str | None = None
        self.rank = 0
        self.publisher: Publisher | None = None
        self.receiver: StreamReceiver | None = None
        self.last_version = 0

    # --- per-step lifecycle (verl's CheckpointEngineManager) ---------------------------------

    def prepare(self) -> dict[str, Any]:
        return {"is_master": self.is_master}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        actor = {
            "role": ["actor"] * actor_wg_world_size,
            "rank": list(range(actor_wg_world_size)),
        }
        rollout = {
            "role": ["rollout"] * rollout_world_size,
            "rank": list(range(rollout_world_size)),
        }
        return actor, rollout

    def init_process_group(self, role: str, rank: int, **_: Any) -> None:
        self.role, self.rank = role, rank
        if role == "rollout" and self.receiver is None:
            self.receiver = StreamReceiver(
                self.address,
                expected_names=self.expected_names,
                engine="verl",
                rank=rank,
                verify_checksums=self.verify_checksums,
            )
        elif role == "actor" and self.is_master and self.publisher is None:
            self.publisher = Publisher(self.address, publisher_id=f"verl-{os.getpid()}")
            # A sender that outlived an earlier trainer has seen higher versions.
            versions = [v.version for v in self.publisher.status().versions]
            self.last_version = max(versions, default=0)

    def finalize(self) -> None:
        pass

    # --- the weights -------------------------------------------------------------------------

    @torch.no_grad()
    async def send_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        global_steps: int | None = None,
    ) -> dict[str, float]:
        tensors: dict[str, torch.Tensor] = {}
        keep = self.is_master
        async for name, tensor in _aiter(weights):
            if keep:
                tensor = tensor.detach()
                tensors[name] = tensor.to("cpu") if self.offload == "cpu" else tensor
        if not keep:
            return {}
        if self.publisher is None:  # driven without init_process_group
            self.init_process_group("actor", 0)
        assert self.publisher is not None
        version = next_version(global_steps, self.last_version)
        result = await asyncio.to_thread(
            self.publisher.publish, tensors, version, wait=True, timeout_s=self.timeout_s
        )
        self.last_version = version
        return {
            "weightsync/version": float(version),
            "weightsync/staged_s": result.staged_s,
            "weightsync/receivers": float(result.receivers),
        }

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        if self.receiver is None:
            raise ConfigError(
                "weightsync checkpoint engine: receive_weights before init_process_group "
                "registered this rollout worker with the sender"
            )
        async for item in self.receiver.areceive(self.timeout_s):
            yield item
        self.last_version = self.receiver.last_version

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self.receiver is not None:
            self.receiver.close()


async def _aiter(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item
