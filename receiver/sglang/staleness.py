"""Per-token staleness in SGLang's outputs: ``policy_epoch``, ``kv_cache_epoch``, ``num_evictions``
in ``meta_info``, beside SGLang's own ``weight_versions``.

Installed by SGLang's general-plugin entry point (``sglang.srt.plugins``: ``weightsync``,
:mod:`weightsync.receiver.sglang_plugin`), which SGLang runs at the start of each of its
processes (engine / HTTP server, scheduler, detokenizer). Active only in engines launched with
weightsync's weight loader (``--custom-weight-loader`` naming
``weightsync.receiver.sglang.hook.sync_weights``); other engines' outputs stay as they were.

Where the facts come from:

- **Versions** (scheduler process): every forward batch runs under the scheduler's
  weight-version label at that moment (``get_serving().weight_version``; the drivers set it
  to ``str(version)``; while weights change SGLang's scheduler runs no batch), and writes KV
  into the slots of ``batch.out_cache_loc``. A table keeps the version per KV slot, and each
  request its runs (:class:`RequestEpochs`): a prefill (or a chunk, or the recompute after a
  retraction) computes ``[prefix_len, prefix_len + extend_len)`` and takes the prefix's
  versions from the slots the radix cache served; a decode step computes position
  ``seq_len - 1``. A step computing up to position ``end - 1`` samples output token
  ``end - prompt_len``. Attributing tokens here rather than from SGLang's own
  ``weight_versions`` spans keeps them exact under the overlap scheduler, where a pause in place
  leaves one step in flight whose token SGLang's spans give to the new version.
- **Evictions**: SGLang counts a request's retractions (``Req.retraction_count``).

The scheduler hands the finished request's fields to the tokenizer manager through SGLang's
``customized_info`` channel (one value per output token; the fields ride on the last one), and
the tokenizer manager's ``update_request_meta_info`` moves them into ``meta_info``.

SGLang has no public hook for the scheduler's batches, so this module patches its classes, all
here, each target checked first: a SGLang whose layout differs fails at scheduler startup with
a :class:`ConfigError` naming what moved, never with silently wrong fields.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.errors import ConfigError, VersionError
from weightsync.receiver.patching import Wrap, patch
from weightsync.receiver.sglang.hook import HOOK_PATH
from weightsync.staleness import (
    Runs,
    Staleness,
    extend_runs,
    run_length,
    truncate_runs,
    version_of_label,
)

logger = logging.getLogger(__name__)

FIELDS = ("policy_epoch", "kv_cache_epoch", "num_evictions")
"""The keys added to a finished request's ``meta_info``."""

CARRIER = "weightsync_staleness"
"""The ``customized_info`` key carrying the scheduler's fields to the tokenizer manager."""

SUPPORTED = "SGLang 0.5.23"

_TRACKER = "_weightsync_kv"
_SLOTS = "_weightsync_slot_versions"

_warned_labels: set[str] = set()


def enabled(server_args: Any) -> bool:
    """Whether an engine with these ``ServerArgs`` reports the fields: it runs weightsync's
    weight loader."""
    return HOOK_PATH in (getattr(server_args, "custom_weight_loader", None) or ())


def _layout_error(what: str) -> ConfigError:
    import sglang

    return ConfigError(
        f"weightsync staleness hooks: {what} in SGLang {sglang.__version__} (written for "
        f"{SUPPORTED}); pin a supported SGLang or update receiver/sglang/staleness.py"
    )


def _patch(owner: Any, name: str, make: Wrap, params: tuple[str, ...] = ()) -> None:
    patch(owner, name, make, params, _layout_error)


SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
TOKENIZER_MODULE = "sglang.srt.managers.tokenizer_manager"


def install() -> None:
    """Hook scheduler construction and the tokenizer manager's ``meta_info``, in whichever of
    their modules this process has loaded (safe to call more than once, in every SGLang
    process). SGLang loads plugins after importing them: the scheduler process from
    ``scheduler.py``, the engine and the HTTP server after importing both; the detokenizer,
    which needs neither, is spared importing them. The batch hooks follow in a scheduler whose
    engine runs weightsync's loader."""
    if SCHEDULER_MODULE in sys.modules:
        _patch(sys.modules[SCHEDULER_MODULE].Scheduler, "__init__", _scheduler_constructor)
    if TOKENIZER_MODULE in sys.modules:
        _patch(
            sys.modules[TOKENIZER_MODULE].TokenizerManager,
            "update_request_meta_info",
            _update_request_meta_info,
            ("meta_info", "customized_info", "index"),
        )


def _scheduler_constructor(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not enabled(self.server_args):
            return
        spec = getattr(self, "spec_algorithm", None)
        if spec is None or not callable(getattr(spec, "is_none", None)):
            raise _layout_error("Scheduler has no spec_algorithm.is_none()")
        if not spec.is_none():
            # Speculative steps write draft KV and verify several tokens per step.
            logger.warning(
                "weightsync: no kv_cache_epoch/num_evictions with speculative decoding; "
                "outputs carry SGLang's weight_versions only"
            )
            return
        _install_scheduler_hooks()
        allocator = getattr(self, "token_to_kv_pool_allocator", None)
        if not all(hasattr(allocator, a) for a in ("size_full", "page_size", "device")):
            raise _layout_error("Scheduler.token_to_kv_pool_allocator lacks size_full/page_size")
        setattr(self, _SLOTS, SlotVersions.of_pool(allocator))

    return __init__


# --- the scheduler process ---------------------------------------------------------------------


class SlotVersions:
    """The version whose weights computed each KV slot of the pool (-1: not computed by a batch
    seen here, e.g. loaded from a host cache). Sized once from the pool, so recording a batch
    is one scatter on the pool's device, without a host sync."""

    def __init__(self, num_slots: int, device: torch.device | str) -> None:
        self.table = torch.full((num_slots,), -1, dtype=torch.int32, device=device)

    @classmethod
    def of_pool(cls, allocator: Any) -> SlotVersions:
        # Slot indexes run to the pool size (full-attention slots for hybrid pools), plus
        # page padding.
        size, page_size = int(allocator.size_full), int(allocator.page_size)
        return cls(size + 2 * page_size + 1, allocator.device)

    def write(self, slots: torch.Tensor, version: int) -> None:
        self.table[slots] = version

    def read(self, slots: torch.Tensor) -> list[int]:
        return self.table[slots].tolist()


@dataclass
class RequestEpochs:
    """One request's versions: of each KV position and of each sampled token (``None`` once
    unknown). A step that computes KV up to position ``end - 1`` samples output token
    ``end - prompt_len``: new if it is the next one, a recomputed one's successor otherwise."""

    prompt_len: int
    kv: Runs | None = field(default_factory=list)
    num_kv: int = 0
    policy: Runs | None = field(default_factory=list)
    num_tokens: int = 0

    def compute(self, prefix: list[int], end: int, version: int) -> None:
        """A prefill (or chunk, or recompute): ``prefix`` is the version per cached position."""
        if self.kv is not None and -1 not in prefix:
            self.kv = run_length(prefix)
            self.num_kv = extend_runs(self.kv, len(prefix), len(prefix), end, version)
        else:
            self.kv = None
        self._sampled(end - self.prompt_len, version)

    def decode(self, position: int, version: int) -> None:
        if self.kv is not None and position <= self.num_kv:
            self.num_kv = extend_runs(self.kv, self.num_kv, position, position + 1, version)
        else:  # a position we never saw computed
            self.kv = None
        self._sampled(position + 1 - self.prompt_len, version)

    def _sampled(self, index: int, version: int) -> None:
        # Below num_tokens: a chunk of a recompute (its token was sampled before). Above: a
        # token we never saw sampled.
        if self.policy is None or index < self.num_tokens:
            return
        if index > self.num_tokens:
            self.policy = None
            return
        self.num_tokens = extend_runs(self.policy, index, index, index + 1, version)

    def forget(self) -> None:
        self.kv = self.policy = None

    def report(self, num_tokens: int, num_evictions: int) -> Staleness | None:
        """The fields for the first ``num_tokens`` output tokens (None: versions unknown)."""
        if self.policy is None or self.num_tokens < num_tokens:
            return None
        num_kv = self.prompt_len + num_tokens - 1
        known = self.kv is not None and self.num_kv >= num_kv
        return Staleness(
            truncate_runs(self.policy, num_tokens),
            truncate_runs(self.kv, num_kv) if known and self.kv is not None else None,
            num_evictions,
        )


def _tracker(req: Any) -> RequestEpochs:
    tracker = req.__dict__.get(_TRACKER)
    if tracker is None:
        tracker = RequestEpochs(len(req.origin_input_ids))
        setattr(req, _TRACKER, tracker)
    return tracker


def _current_version() -> int | None:
    from sglang.srt.runtime_context import get_serving

    label = get_serving().weight_version
    try:
        return version_of_label(label)
    except VersionError as e:
        if label not in _warned_labels:
            _warned_labels.add(label)
            logger.warning("weightsync: no staleness fields for this version: %s", e)
        return None


def _record(scheduler: Any, batch: Any) -> None:
    """Attribute the KV this batch computes to the current version (before it runs: the
    scheduler changes no weights between building a batch and running it)."""
    mode = batch.forward_mode
    if not batch.reqs or mode.is_idle():
        return
    version = _current_version()
    slots: SlotVersions = getattr(scheduler, _SLOTS)
    n = len(batch.reqs)
    if version is not None and mode.is_decode() and len(batch.seq_lens_cpu) == n:
        for req, seq_len in zip(batch.reqs, batch.seq_lens_cpu.tolist(), strict=True):
            _tracker(req).decode(seq_len - 1, version)
    elif (
        version is not None
        and mode.is_extend()  # a prefill, a chunk, or prefills mixed with decodes
        and len(batch.req_pool_indices_cpu) == len(batch.prefix_lens) == n
    ):
        req_to_token = batch.req_to_token_pool.req_to_token
        rows = batch.req_pool_indices_cpu.tolist()
        for req, row, prefix_len, extend_len in zip(
            batch.reqs, rows, batch.prefix_lens, batch.extend_lens, strict=True
        ):
            prefix = slots.read(req_to_token[row, :prefix_len])
            _tracker(req).compute(prefix, prefix_len + extend_len, version)
    else:  # a label that is no version, or a batch whose rows are not one per request
        for req in batch.reqs:
            _tracker(req).forget()
    if batch.out_cache_loc is not None:
        slots.write(batch.out_cache_loc, -1 if version is None else version)


def _attach(req: Any) -> None:
    """Put a finishing request's fields on its last output token's ``customized_info``."""
    tracker: RequestEpochs | None = req.__dict__.get(_TRACKER)
    num_tokens = len(req.output_ids_through_stop)
    if tracker is None or num_tokens == 0:
        return
    report = tracker.report(num_tokens, int(req.retraction_count))
    if report is not None:
        req.customized_info = {
            **(req.customized_info or {}),
            CARRIER: [None] * (num_tokens - 1) + [report.as_dict()],
        }


_BATCH_FIELDS = (
    "reqs",
    "forward_mode",
    "out_cache_loc",
    "seq_lens_cpu",
    "prefix_lens",
    "extend_lens",
    "req_pool_indices_cpu",
    "req_to_token_pool",
)
"""What :func:`_record` reads from each ``ScheduleBatch``."""
_REQ_ATTRIBUTES = ("retraction_count", "customized_info", "origin_input_ids", "finished_output")
"""What :func:`_attach` reads and writes on each ``Req``."""


def _install_scheduler_hooks() -> None:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.output_streamer import (
        SchedulerOutputStreamer,
    )
    from sglang.srt.runtime_context import get_serving

    batch_fields = getattr(ScheduleBatch, "__dataclass_fields__", {})
    for name in _BATCH_FIELDS:
        if name not in batch_fields:
            raise _layout_error(f"ScheduleBatch has no field {name!r}")
    # Req sets its attributes in __init__ (no declared fields to check).
    init = inspect.getsource(Req.__init__)
    for name in _REQ_ATTRIBUTES:
        if f"self.{name}" not in init:
            raise _layout_error(f"Req.__init__ no longer sets {name!r}")
    if not isinstance(getattr(Req, "output_ids_through_stop", None), property):
        raise _layout_error("Req.output_ids_through_stop is no longer a property")
    # The scheduler's published serving config (this runs in a built scheduler).
    if not hasattr(get_serving(), "weight_version"):
        raise _layout_error("get_serving() has no weight_version")

    def run_batch(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            if hasattr(self, _SLOTS):
                _record(self, batch)
            return original(self, batch, *args, **kwargs)

        return wrapper

    def stream_output(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, reqs: Any, *args: Any, **kwargs: Any) -> Any:
            for req in reqs:
                if req.finished() and not req.finished_output:
                    _attach(req)
            return original(self, reqs, *args, **kwargs)

        return wrapper

    _patch(Scheduler, "run_batch", run_batch, ("batch",))
    _patch(SchedulerOutputStreamer, "stream_output", stream_output, ("reqs",))


# --- the tokenizer manager (engine / HTTP server process) --------------------------------------


def _update_request_meta_info(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        customized_info = bound.arguments["customized_info"]
        if CARRIER not in customized_info:
            return original(*bound.args, **bound.kwargs)
        values = customized_info[CARRIER][bound.arguments["index"]]
        bound.arguments["customized_info"] = {
            key: value for key, value in customized_info.items() if key != CARRIER
        }
        original(*bound.args, **bound.kwargs)
        fields = next((v for v in reversed(values or ()) if isinstance(v, dict)), None)
        if fields is not None:
            bound.arguments["meta_info"].update(fields)

    return wrapper
