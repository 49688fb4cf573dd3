"""The trainer side of vLLM's weight transfer with backend ``weightsync``.

vLLM's RL flow builds a trainer engine with ``WeightTransferTrainerFactory.trainer_init(init_info,
client=..., source=...)`` and calls ``send_weights()`` once per sync; the backend is chosen by
the init info's class. Switching a vLLM RL script (``examples/rl/rlhf_http_nccl.py`` style) to
weightsync is that one argument::

    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory)
    from weightsync.drivers.vllm_trainer import WeightsyncTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        WeightsyncTrainerInitInfo(rank=0),          # was NCCLTrainerInitInfo(...) / IPC...
        client=HTTPVLLMWeightSyncClient("http://127.0.0.1:8000"),
        source=ModuleSource(model),
    )
    engine.send_weights()                           # or send_weights(weight_version="step-10")

with the server started with ``--weight-transfer-config '{"backend": "weightsync"}'``.
Importing this module registers the engine (so does vLLM's plugin loading, through the
``vllm.general_plugins`` entry point).

The sender: ``address`` in the init info, else ``$WEIGHTSYNC_LISTEN`` (the variable the sender
daemon listens on), else the engine starts a sender inside the trainer process (rank 0) on a
fresh unix socket (``listen`` to choose another address; ``sender_settings`` and
``WEIGHTSYNC_*`` variables for its settings) and closes it at ``shutdown()``.

Versions: weightsync versions are increasing integers; vLLM's ``weight_version`` is free text.
Each ``send_weights`` publishes the next integer (one above the sender's last version when the
engine was built) and sets the server's ``weight_version`` to the label given, or to the integer
as text when none is given. :attr:`WeightsyncTrainerEngine.versions` maps integer -> label in
the order sent; :meth:`~WeightsyncTrainerEngine.version_of` maps a label back (the latest send
with that label: labels need not be unique or ordered).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from weightsync.errors import ConfigError, ReceiverFailedError, WeightSyncError
from weightsync.receiver.vllm_plugin import BACKEND_NAME, register_trainer_engine

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient, WeightSource

    from weightsync.sender import Publisher, Sender

logger = logging.getLogger(__name__)

_UPDATE_GRACE_S = 30.0
"""After a failed publish, how long to wait for the server's update_weights to fail too."""
_PUBLISH_GRACE_S = 10.0
"""After a failed update_weights, how long to wait for the sender's reason."""


@dataclass
class WeightsyncTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``weightsync`` backend (``rank`` is keyword-only; rank 0
    publishes and drives the server, the other ranks only iterate the source)."""

    backend: ClassVar[str] = BACKEND_NAME

    address: str | None = None
    """A running sender's ``unix:/path`` or ``host:port``. None: ``$WEIGHTSYNC_LISTEN`` (unless
    ``listen`` is given), else start a sender in this process."""
    listen: str | None = None
    """Where the sender this engine starts listens (only without ``address``); default a unix
    socket in a fresh temporary directory (engines on this host only)."""
    sender_settings: dict[str, Any] = field(default_factory=dict)
    """``SenderSettings`` fields for the sender this engine starts (bucket_size_bytes,
    transport, ...); unset ones come from ``WEIGHTSYNC_*`` variables."""
    receiver_address: str | None = None
    """The address the server's workers dial, when it differs from the trainer's (a sender
    listening on ``0.0.0.0:P`` reached as ``trainer-host:P``). Default: the same."""
    receiver_id: str | None = None
    """Prefix of the workers' receiver ids (``<prefix>-rank<N>``); default generated."""
    verify_checksums: bool = True
    """Workers compare every bucket's checksum with the sender's before committing."""
    connect_timeout_s: float = 10.0
    """How long the trainer and the workers wait for the sender to answer."""
    timeout_s: float = 600.0
    """How long one ``send_weights`` may take (publish and apply)."""

    def __post_init__(self) -> None:
        if self.address is not None and self.listen is not None:
            raise ConfigError("weightsync: give 'address' (a running sender) or 'listen', not both")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ConfigError(
                f"weightsync: timeout_s and connect_timeout_s must be > 0, got "
                f"{self.timeout_s} and {self.connect_timeout_s}"
            )


class WeightsyncTrainerEngine(TrainerWeightTransferEngine[WeightsyncTrainerInitInfo]):
    """Publishes the source's tensors through a weightsync sender and drives the server's
    ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` through vLLM's
    client. Pausing generation around ``send_weights`` is the caller's, as with vLLM's own
    engines (``/pause`` drops the prefix cache, which holds KV of the old weights)."""

    init_info_cls = WeightsyncTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool = True,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.timeout_s = timeout_s
        self.address: str | None = None
        """The sender's address as this process dials it (rank 0)."""
        self.sender: Sender | None = None
        """The sender this engine started, if it started one."""
        self.publisher: Publisher | None = None
        self.versions: dict[int, str] = {}
        """weightsync version -> the ``weight_version`` label it was sent as, in send order."""
        self.version = 0
        """The last weightsync version the server applied (0: none yet)."""
        self._next_version = 1
        self._socket_dir: str | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: WeightsyncTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ConfigError("weightsync trainer weight transfer needs a WeightSource")
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            timeout_s=init_info.timeout_s,
        )
        if not engine.is_sender:
            return engine
        try:
            engine._connect(init_info)
        except BaseException:
            engine._close_publisher()
            engine._close_sender()
            raise
        return engine

    def _connect(self, init_info: WeightsyncTrainerInitInfo) -> None:
        from weightsync.sender import Publisher

        address = init_info.address
        if address is None and init_info.listen is None:
            address = os.environ.get("WEIGHTSYNC_LISTEN")
        if address is None:
            from weightsync.sender import Sender

            listen = init_info.listen
            if listen is None:
                self._socket_dir = tempfile.mkdtemp(prefix="weightsync-")
                listen = f"unix:{self._socket_dir}/sender.sock"
            self.sender = Sender(listen, **init_info.sender_settings)
            address = self.sender.address
            logger.info("weightsync: started a sender at %s", address)
        elif init_info.sender_settings:
            raise ConfigError(
                f"weightsync: sender_settings apply to a sender this engine starts, but one "
                f"runs at {address}; set them where it was started"
            )
        self.address = address
        self.publisher = Publisher(address, connect_timeout_s=init_info.connect_timeout_s)
        # Versions must increase across trainer restarts against a long-lived sender.
        history = self.publisher.status().versions
        self._next_version = max((v.version for v in history), default=0) + 1
        worker_init = {
            "address": init_info.receiver_address or address,
            "verify_checksums": init_info.verify_checksums,
            "connect_timeout_s": init_info.connect_timeout_s,
        }
        if init_info.receiver_id is not None:
            worker_init["receiver_id"] = init_info.receiver_id
        # Workers register with the sender inside this call, so every version published
        # afterwards is addressed to them.
        self.client.init_weight_transfer_engine(worker_init)

    def version_of(self, weight_version: str) -> int:
        """The weightsync version last sent with the label ``weight_version``.

        Raises:
            KeyError: no version was sent with that label.
        """
        for version in reversed(self.versions):
            if self.versions[version] == weight_version:
                return version
        raise KeyError(f"no version was sent as weight_version {weight_version!r}")

    @property
    def weight_version(self) -> str | None:
        """The label of the last version the server applied (None: none yet)."""
        return self.versions.get(self.version)

    def send_weights(self, weight_version: str | None = None) -> int:
        """Publish the source's tensors as the next version and return once the server
        serves it; called on every trainer rank (others only iterate the source).

        Args:
            weight_version: the server's free-text ``weight_version`` for this update
                (default: the weightsync version as text).

        Returns:
            The weightsync version sent.

        Raises:
            ReceiverFailedError: the server failed to apply the version (vLLM's answer and the
                sender's reason, e.g. a tensor name the model lacks); the server keeps the
                previous weights and weight version.
        """
        assert self.source is not None
        version = self._next_version
        self._next_version += 1
        label = str(version) if weight_version is None else str(weight_version)
        if not self.is_sender:
            for _ in self.source:  # stay in the trainer-side gather collectives
                pass
            self.versions[version] = label
            self.version = version
            return version
        with torch.no_grad():
            tensors = {}
            for name, tensor in self.source:
                if tensor is None:
                    raise ConfigError(
                        f"weightsync: the source yielded no tensor for {name!r} on rank 0; "
                        "the weightsync trainer engine publishes from rank 0, which needs "
                        "every tensor (a source whose held_names() is all of them)"
                    )
                tensors[name] = tensor.detach()
        self._apply(tensors, version)
        self.client.finish_weight_update(weight_version=label)
        self.versions[version] = label
        self.version = version
        logger.info("weightsync: version %d applied as weight_version %r", version, label)
        return version

    def _apply(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Publish ``version`` while the server applies it (``update_weights`` blocks until
        the receivers have loaded it, so both run at once)."""
        if self.publisher is None:  # dropped after a failed update; connect again
            from weightsync.sender import Publisher

            assert self.address is not None
            self.publisher = Publisher(self.address)
        publisher = self.publisher
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="weightsync-send")
        applying = pool.submit(
            self.client.update_weights, {"version": version, "timeout_s": self.timeout_s}
        )
        publishing = pool.submit(
            publisher.publish, tensors, version, wait=True, timeout_s=self.timeout_s
        )
        wait([applying, publishing], return_when=FIRST_EXCEPTION)
        if _failed(applying) and not publishing.done():
            # A worker that rejected the version has told the sender why; one that never
            # took it (e.g. no init) leaves the sender waiting for its acks until its timeout:
            # then abandon the version.
            wait([publishing], timeout=_PUBLISH_GRACE_S)
            if not publishing.done():
                self.publisher = None
                publisher.close()
        elif _failed(publishing) and not applying.done():
            # A receiver's failure reaches the server at once; anything else (the sender
            # refused the version) leaves the workers waiting for it until timeout_s.
            wait([applying], timeout=_UPDATE_GRACE_S)
            if not applying.done():
                pool.shutdown(wait=False)
                raise WeightSyncError(
                    f"weightsync version {version} was not published: "
                    f"{publishing.exception()}; the server's update_weights still waits for "
                    f"it (up to {self.timeout_s:.0f} s)"
                ) from publishing.exception()
        pool.shutdown(wait=True)
        update_error, publish_error = applying.exception(), publishing.exception()
        if update_error is None and publish_error is None:
            return
        if update_error is not None:
            # With several workers only the last rank raised (receiver.vllm.engine): the others
            # are still in vLLM's update session. Ranks the failure ended say none is open.
            with contextlib.suppress(Exception):
                self.client.finish_weight_update()
        if update_error is None:
            raise publish_error  # type: ignore[misc]
        if publish_error is None or publisher is not self.publisher:
            raise ReceiverFailedError(
                f"vLLM update_weights failed for weightsync version {version}: {update_error}"
            ) from update_error
        # vLLM answers a failed update with a bare 500; the sender knows why.
        raise ReceiverFailedError(
            f"vLLM update_weights failed for weightsync version {version}: {update_error}; "
            f"the sender reports: {publish_error}"
        ) from publish_error

    def shutdown(self) -> None:
        """Drop the server's receivers (when the client can), close the publisher, and stop
        the sender if this engine started it."""
        if self.is_sender:
            drop = getattr(self.client, "shutdown_weight_transfer_engine", None)
            if drop is not None:
                try:
                    drop()
                except Exception as e:  # the server may be gone already
                    logger.warning("weightsync: shutdown_weight_transfer_engine failed: %s", e)
        self._close_publisher()
        self._close_sender()

    def _close_publisher(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def _close_sender(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None


def _failed(future: Future) -> bool:
    return future.done() and future.exception() is not None


register_trainer_engine()
