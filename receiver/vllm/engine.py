"""The ``weightsync`` backend of vLLM's weight-transfer engine registry.

Users start vLLM with ``--weight-transfer-config '{"backend": "weightsync"}'`` and drive
updates through vLLM's own routes::

    POST /init_weight_transfer_engine  {"init_info": {"address": "unix:/run/ws.sock"}}
    POST /start_weight_update
    POST /update_weights               {"update_info": {"version": 3}}   # blocks until applied
    POST /finish_weight_update         {"weight_version": "3"}

``init`` subscribes every worker to the sender (one receiver per worker); ``update_weights``
applies the next version the sender announces (validate, load every bucket, post-process
once, register the LoRA adapter) and fails when it is not the version asked for.

With several workers (TP, PP), vLLM's multiprocess executor reads their replies in rank order
and raises at the first error, leaving the later ranks' replies to be read by its next call
(which then fails with this one's error). So ``update_weights`` never raises on one rank
alone: the ranks gather their outcomes and only the last rank, whose reply is read last,
raises, naming every rank's error. The other ranks are then still in vLLM's update session:
whoever drives the update ends it with ``/finish_weight_update`` (``VllmServerClient`` does).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsync.errors import ConfigError, ProtocolError, ReceiverFailedError, VersionError
from weightsync.receiver.vllm.lora_store import LoraStore
from weightsync.receiver.vllm.target import VllmWeightTarget, draft_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

    from weightsync.receiver.core import ReceiverCore

BACKEND_NAME = "weightsync"

logger = logging.getLogger(__name__)


@dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    """What ``/init_weight_transfer_engine`` carries for the ``weightsync`` backend."""

    address: str
    """The sender daemon's control-plane address (``unix:/path`` or ``host:port``)."""
    receiver_id: str | None = None
    """Prefix of this engine's receiver ids; each worker appends ``-rank<N>``. Default: host
    name, process id and a random suffix."""
    lora_dir: str | None = None
    """Where LoRA adapters are written; unique per engine when engines share a host."""
    verify_checksums: bool = True
    """Compare every bucket's checksum with the sender's before committing the version."""
    connect_timeout_s: float = 10.0
    """How long to wait for the sender to answer at ``address``."""

    def __post_init__(self) -> None:
        if not self.address:
            raise ConfigError("weightsync init_info needs the sender's 'address'")
        if self.connect_timeout_s <= 0:
            raise ConfigError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """What ``/update_weights`` carries: the version to apply."""

    version: int | None = None
    """The version to apply; the call fails if the sender announces another. None: the next."""
    timeout_s: float | None = 600.0
    """How long to wait for the version to be announced and applied (None: forever)."""

    def __post_init__(self) -> None:
        if self.version is not None and self.version < 1:
            raise ConfigError(f"version must be >= 1, got {self.version}")


class WeightsyncTransferEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    """One per vLLM worker: a weightsync receiver loading into the worker's model."""

    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.core: ReceiverCore | None = None
        self.target: VllmWeightTarget | None = None
        self.applied_version = 0
        self.draft = draft_of(_runner_holding(model), vllm_config)
        speculative = getattr(vllm_config, "speculative_config", None)
        if self.draft is None and getattr(speculative, "method", None) == "mtp":
            logger.warning(
                "weightsync: this engine runs MTP speculative decoding but its draft model was "
                "not found on the worker; MTP layers of each version will be ignored"
            )
        if self.draft is not None:
            # Each version loads into the MTP draft model with the target model, in the main
            # session; a draft session would wait for the version after it.
            self.supports_draft_weight_update = False

    @property
    def rank(self) -> int:
        return self.parallel_config.data_parallel_index * self.parallel_config.world_size + (
            self.parallel_config.rank
        )

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        from weightsync.receiver.core import ReceiverCore

        self.shutdown()
        lora_store = (
            LoraStore(init_info.lora_dir, None, self.vllm_config.lora_config)
            if self.vllm_config.lora_config
            else None
        )
        # After each sync the worker calls reset_lora_state itself; the adapter is then
        # reloaded from lora_store's path by the next request that names it.
        self.target = VllmWeightTarget(
            self.model,
            self.model_config,
            self.device,
            draft=self._draft_for(self.model),
            lora_store=lora_store,
        )
        # Unique per engine even when several share a process (in-process engines).
        prefix = init_info.receiver_id or (
            f"vllm-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.core = ReceiverCore(
            self.target,
            init_info.address,
            engine="vllm",
            rank=self.rank,
            receiver_id=f"{prefix}-rank{self.rank}",
            verify_checksums=init_info.verify_checksums,
            connect_timeout_s=init_info.connect_timeout_s,
        )

    def start_weight_update(self) -> None:
        # Validation and layerwise setup need the version's manifest, so they run inside
        # update_weights; here only follow vLLM's choice of model (main or draft).
        if self.target is not None:
            self.target.retarget(self.model, self.model_config, self._draft_for(self.model))

    def _draft_for(self, model: torch.nn.Module) -> tuple[torch.nn.Module, Any] | None:
        """The MTP draft model loads with the main model, not with another one."""
        return self.draft if model is self._default_model else None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Apply the version on every rank; raises only on the last rank, with every rank's
        error (see the module docstring)."""
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
        try:
            super().update_weights(update_info)
            outcome = None
        except Exception as e:
            if group.world_size == 1:
                raise
            outcome = f"{type(e).__name__}: {e}"
        if group.world_size == 1:
            return
        outcomes: list[str | None] = [None] * group.world_size
        torch.distributed.all_gather_object(outcomes, outcome, group=group.cpu_group)
        failures = [(rank, error) for rank, error in enumerate(outcomes) if error is not None]
        if failures and group.rank_in_group == group.world_size - 1:
            raise ReceiverFailedError(
                f"weightsync: the update failed on {len(failures)} of {group.world_size} "
                "ranks: " + "; ".join(f"rank {rank}: {error}" for rank, error in failures)
            )

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        if self.core is None:
            raise ProtocolError(
                "weightsync: update_weights before init_weight_transfer_engine; call "
                "/init_weight_transfer_engine with the sender's address first"
            )
        # A version asked for earlier and given up on may still be announced: skipped.
        applied = self.core.sync(update_info.timeout_s, update_info.version)
        self.applied_version = applied
        if update_info.version is not None and applied != update_info.version:
            raise VersionError(
                f"weightsync: asked to apply version {update_info.version} but the sender "
                f"announced {applied} (now applied); publish versions in the order you apply them"
            )

    def finish_weight_update(self) -> None:
        # Post-load processing already ran once, after the version's last bucket.
        pass

    def shutdown(self) -> None:
        if self.core is not None:
            self.core.close()
            self.core = None


def _runner_holding(model: torch.nn.Module) -> Any | None:
    """The model runner serving ``model``, found on the call stack.

    vLLM creates this engine inside its worker's ``load_model`` and hands it the main model
    only; the MTP draft model lives on the worker's model runner (``get_draft_model``).
    """
    frame = sys._getframe(1)
    while frame is not None:
        runner = getattr(frame.f_locals.get("self"), "model_runner", None)
        get_model = getattr(runner, "get_model", None)
        if callable(get_model) and get_model() is model:
            return runner
        frame = frame.f_back
    return None


def register_engine() -> None:
    """Register the backend with vLLM's registry; safe to call more than once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND_NAME, "weightsync.receiver.vllm.engine", "WeightsyncTransferEngine"
        )
    except ValueError as e:
        # vLLM loads general plugins more than once per process (and in every process).
        if "already registered" not in str(e):
            raise
