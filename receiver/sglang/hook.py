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
the receivers registered when it is published).

LoRA: on a server launched with ``--enable-lora`` (and ``--max-lora-rank``,
``--lora-target-modules``), a version carrying an adapter loads it into the worker's
``LoRAManager``, replacing the adapter of that name in place (``SglangLoraLoader``). SGLang
passes the hook the model only and offers no way from a model to the ``ModelRunner`` that owns
the LoRA manager, so :func:`model_runner_of` finds the runner whose ``model`` is that model
among the process's live objects, once per model; if SGLang renames or restructures
``ModelRunner`` the first version fails with a ``ConfigError`` saying so. Requests route to the
adapter by name only once SGLang's tokenizer side knows the name: launch with ``--lora-paths
NAME=PATH`` (any PEFT adapter of the same shape) or call ``/load_lora_adapter`` once before the
first version. Without ``--enable-lora`` a version carrying an adapter is rejected before any
write.

Draft (MTP / speculative) models are not handled: SGLang calls the hook once per model runner,
with that runner's model only, so the target's and the draft's halves of a version could not
commit together; send the update with ``selector="target"`` (the client's default). MTP layers
in the version are ignored here, with a warning; ``SglangWeightTarget(model, device,
draft=...)`` loads them where the caller holds both models.

Failures: SGLang 0.5.23 ignores what a custom loader returns and does not catch what it
raises (the scheduler process dies, and the server with it). So a version that fails without
writing anything (a manifest that does not fit, an adapter the server cannot hold, a timeout)
is logged and SGLang answers the update as a success, keeping the previous weights; the trainer
learns of the failure from the sender (``publish(..., wait=True)`` raises
``ReceiverFailedError`` naming the worker and why), so check that, not only the HTTP answers.
Anything else (tensors in the request, a receiver that cannot be set up, a version that failed
after writing weights) is raised, and the server exits rather than serve weights that match no
version.

Tested in a real offline ``sglang.Engine`` on CPU (tests/sglang/test_engine_hook.py, TP=1,
driven through the Engine's methods that ``SglangHttpClient`` calls over HTTP): base versions
bit-exact, LoRA adapters replaced in place and served by name, refused adapters.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from weightsync.errors import ConfigError, WeightSyncError
from weightsync.receiver.core import ReceiverCore
from weightsync.receiver.sglang.lora_loader import SglangLoraLoader
from weightsync.receiver.sglang.target import SglangWeightTarget

logger = logging.getLogger(__name__)

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


_RUNNER_CLASS = "sglang.srt.model_executor.model_runner.ModelRunner"


def model_runner_of(model: torch.nn.Module) -> Any:
    """The SGLang ``ModelRunner`` whose ``model`` is ``model`` in this process.

    SGLang 0.5.23 calls the custom loader with ``get_model()`` only and has no accessor from a
    model back to its runner, so this scans the process's live objects (once per model, at its
    first version).

    Raises:
        ConfigError: ``ModelRunner`` moved, or no runner (or several) holds ``model`` as
            ``.model``.
    """
    try:
        from sglang.srt.model_executor.model_runner import ModelRunner
    except ImportError as e:
        raise ConfigError(
            f"{HOOK_PATH} finds the LoRA manager through {_RUNNER_CLASS}, which this SGLang "
            f"does not have ({e}); LoRA through the hook needs SGLang 0.5.23's layout"
        ) from e
    # type() rather than isinstance(): some live objects answer __class__ lazily.
    runners = [
        obj
        for obj in gc.get_objects()
        if issubclass(type(obj), ModelRunner) and getattr(obj, "model", None) is model
    ]
    if len(runners) != 1:
        raise ConfigError(
            f"{HOOK_PATH} found {len(runners)} {_RUNNER_CLASS} objects whose .model is the "
            f"model SGLang passed it ({type(model).__name__}), expected 1: SGLang changed how "
            "a runner holds its model; LoRA through the hook needs SGLang 0.5.23's layout"
        )
    return runners[0]


def _lora_loader(model: torch.nn.Module) -> SglangLoraLoader | None:
    from sglang.srt.runtime_context import get_lora

    if not get_lora().enable_lora:
        return None  # the target then rejects a version carrying an adapter, before any write
    manager = getattr(model_runner_of(model), "lora_manager", None)
    if manager is None:
        raise ConfigError(
            f"SGLang runs with --enable-lora but the {_RUNNER_CLASS} holding the model has no "
            "lora_manager: SGLang changed where the LoRA manager lives"
        )
    return SglangLoraLoader(manager)


def receiver_for(model: torch.nn.Module) -> ReceiverCore:
    """This worker's receiver for ``model``, registering it with the sender on first use.

    Raises:
        ConfigError: ``WEIGHTSYNC_ADDRESS`` is not set, or LoRA is on and the worker's LoRA
            manager cannot be found (see :func:`model_runner_of`).
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
    target = SglangWeightTarget(
        model, _model_device(model), lora_loader=_lora_loader(model), process_quantized=False
    )
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

    SGLang 0.5.23 ignores what a custom loader returns and does not catch what it raises: an
    exception ends the scheduler process, and with it the server. So a version this worker
    refused or failed WITHOUT writing a weight (a manifest that does not fit the model, an
    adapter the server cannot hold, a timeout) is logged and returns normally: the previous
    version stays and SGLang answers the update as a success; the failure reaches the trainer
    through the sender (``publish(..., wait=True)`` raises ``ReceiverFailedError`` naming this
    worker and why).

    Raises:
        ConfigError: the request carried tensors (this hook receives over weightsync only), or
            the receiver could not be set up (see :func:`receiver_for`); the server exits.
        WeightSyncError: the version failed after writing weights (they now match no version);
            the server exits rather than serve them.
    """
    if named_tensors:
        raise ConfigError(
            f"{HOOK_PATH} received {len(named_tensors)} tensor(s) over HTTP (first "
            f"{named_tensors[0][0]!r}); it loads from the weightsync sender only, so send an "
            "empty payload per TP rank"
        )
    timeout_s = float(os.environ.get(TIMEOUT_ENV, "600"))
    receiver = receiver_for(model)
    try:
        receiver.sync(timeout=timeout_s)
    except WeightSyncError as e:
        if receiver.dirty:
            raise
        logger.error(
            "%s: version not applied, nothing written; this worker keeps its weights (SGLang "
            "will report the update as successful; the sender has the failure): %s: %s",
            HOOK_PATH,
            type(e).__name__,
            e,
        )
