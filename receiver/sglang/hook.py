"""The worker-side hook: SGLang's ``update_weights_from_tensor`` runs our receiver in every TP
worker through its custom weight loader mechanism (``load_format`` names a function that SGLang
calls as ``fn(model, named_tensors)`` on each worker's scheduler thread).

Launch the server with the hook allowed, and tell the workers where the sender listens::

    WEIGHTSYNC_ADDRESS=unix:/tmp/weightsync.sock \\
    python -m sglang.launch_server --model-path MODEL --tp-size N \\
        --custom-weight-loader weightsync.receiver.sglang.hook.sync_weights

Optional environment: ``WEIGHTSYNC_SYNC_TIMEOUT_S`` (default 600: how long a worker waits for
the version to start), ``WEIGHTSYNC_VERIFY_CHECKSUMS=0`` to skip bucket checksums.

Then drive one version with :class:`~weightsync.drivers.sglang.SglangHttpClient` (in the RL
framework's process), or POST the same requests yourself: ``/begin_weight_update``, then
``/update_weights_from_tensor`` with ``load_format`` set to the hook's path and one empty
payload per TP rank (the bytes travel over weightsync's data plane, not HTTP), then
``/end_weight_update``. SGLang 0.5.23 refuses ``update_weights_from_tensor`` outside that
session; the session also undoes and redoes quantization packing, so the target here leaves
that to SGLang (``process_quantized=False``).

Each worker registers with the sender on its first call, so the first version must be published
after the first ``/update_weights_from_tensor`` has started (the sender addresses a version to
the receivers registered when it is published). LoRA is not available through this hook: SGLang
passes the model only, not the ``ModelRunner`` that owns the LoRA manager; a version carrying
an adapter is rejected before any write. Draft (MTP / speculative) models are not handled: SGLang
calls the hook once per model runner, with that runner's model only, so the target's and the
draft's halves of a version could not commit together; send the update with
``selector="target"`` (the client's default). MTP layers in the version are ignored here, with a
warning; ``SglangWeightTarget(model, device, draft=...)`` loads them where the caller holds both
models.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from weightsync.errors import ConfigError
from weightsync.receiver.core import ReceiverCore
from weightsync.receiver.sglang.target import SglangWeightTarget

HOOK_PATH = "weightsync.receiver.sglang.hook.sync_weights"
"""What ``--custom-weight-loader`` and the request's ``load_format`` name."""
ADDRESS_ENV = "WEIGHTSYNC_ADDRESS"
TIMEOUT_ENV = "WEIGHTSYNC_SYNC_TIMEOUT_S"
VERIFY_ENV = "WEIGHTSYNC_VERIFY_CHECKSUMS"

_RECEIVERS: dict[int, ReceiverCore] = {}
"""This worker's receiver by ``id(model)``, registered on first use and kept for the process:
it keeps its registration, the buffers it mapped and the manifest it validated, which is what
makes later versions cheap. An id is safe as the key: the worker's model lives as long as the
process."""


def _model_device(model: torch.nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _tp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


def receiver_for(model: torch.nn.Module) -> ReceiverCore:
    """This worker's receiver for ``model``, registering it with the sender on first use.

    Raises:
        ConfigError: ``WEIGHTSYNC_ADDRESS`` is not set.
        TransportError: no sender answers there.
    """
    receiver = _RECEIVERS.get(id(model))
    if receiver is not None:
        return receiver
    address = os.environ.get(ADDRESS_ENV)
    if not address:
        raise ConfigError(
            f"{ADDRESS_ENV} is not set in the SGLang server's environment; set it to the "
            "sender's address (unix:/path or host:port) before launching the server"
        )
    target = SglangWeightTarget(model, _model_device(model), process_quantized=False)
    receiver = ReceiverCore(
        target,
        address,
        engine="sglang",
        rank=_tp_rank(),
        verify_checksums=os.environ.get(VERIFY_ENV, "1") != "0",
    )
    _RECEIVERS[id(model)] = receiver
    return receiver


def sync_weights(model: torch.nn.Module, named_tensors: Sequence[tuple[str, object]]) -> None:
    """SGLang's custom weight loader: apply the next version the sender announces.

    Raises:
        ConfigError: the request carried tensors (this hook receives over weightsync only).
        WeightSyncError: the version failed; SGLang reports the message as the update's
            failure and the previous version stays unless the error says weights were written.
    """
    if named_tensors:
        raise ConfigError(
            f"{HOOK_PATH} received {len(named_tensors)} tensor(s) over HTTP (first "
            f"{named_tensors[0][0]!r}); it loads from the weightsync sender only, so send an "
            "empty payload per TP rank"
        )
    timeout_s = float(os.environ.get(TIMEOUT_ENV, "600"))
    receiver_for(model).sync(timeout=timeout_s)
