"""Per-token staleness in vLLM's outputs: ``policy_epoch``, ``kv_cache_epoch``, ``num_evictions``.

Where the facts come from (all in the process that builds outputs, the API server's or the
offline ``LLM``'s):

- vLLM labels every engine step's outputs with the weight version current when the step ran
  (``EngineCoreOutputs.weight_version``; the drivers set it to ``str(version)`` in
  ``finish_weight_update``). The step loop is paused while weights change, so each step ran
  under exactly the version it reports.
- Preemptions arrive as ``PREEMPTED`` events on the request's next output (only when vLLM logs
  stats: the server's default, ``disable_log_stats=False`` for ``LLM``).

Each request's :class:`~weightsync.staleness.EpochTracker` is fed from
``OutputProcessor.process_outputs``; finished ``CompletionOutput`` objects get three attributes
(``policy_epoch``, ``kv_cache_epoch``, ``num_evictions``), and the OpenAI completion and chat
responses carry them as extra fields of each choice (streamed: of each choice's final chunk).
Only engines whose weight-transfer backend is ``weightsync`` are touched; other engines'
outputs stay as they were.

vLLM has no public hook for any of this, so this module patches vLLM's classes (the OpenAI
server's in :mod:`.staleness_openai`), each target checked first: a vLLM whose layout differs
fails at startup with a :class:`ConfigError` naming what moved, never with silently missing
fields.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from vllm.exceptions import VLLMClientError

from weightsync.errors import ConfigError, VersionError
from weightsync.receiver import patching
from weightsync.receiver.patching import Wrap
from weightsync.staleness import EpochTracker, Staleness, version_of_label

logger = logging.getLogger(__name__)

FIELDS = ("policy_epoch", "kv_cache_epoch", "num_evictions")
"""The attributes set on a finished ``CompletionOutput`` and the extra fields of a choice."""

MAX_POLICY_LAG_ARG = "weightsync_max_policy_lag"
"""A request's staleness bound, in ``SamplingParams.extra_args`` (``vllm_xargs`` over HTTP):
once its oldest token would be more than this many versions behind the version generating, the
request ends with ``finish_reason="abort"`` and the tokens it has."""

_TRACKER = "_weightsync_epochs"
_ACTIVE = "_weightsync_staleness"

SUPPORTED = "vLLM 0.32"

_warned_labels: set[str] = set()
"""Weight-version labels already warned about (once each, not once per step)."""


class PolicyLagError(ConfigError, VLLMClientError):
    """A request's ``weightsync_max_policy_lag`` is not an integer >= 0 (a ``VLLMClientError``
    too, so vLLM's server answers 400, not 500)."""


def staleness_of(completion_output: Any) -> Staleness | None:
    """The fields of a finished ``vllm.CompletionOutput`` (None when the engine does not run the
    ``weightsync`` backend, or the output is not final)."""
    if not hasattr(completion_output, FIELDS[0]):
        return None
    return Staleness(*(getattr(completion_output, name) for name in FIELDS))


def _layout_error(what: str) -> ConfigError:
    import vllm

    return ConfigError(
        f"weightsync staleness hooks: {what} in vLLM {vllm.__version__} (written for "
        f"{SUPPORTED}); pin a supported vLLM or update receiver/vllm/staleness.py"
    )


def _target(owner: Any, name: str, params: tuple[str, ...] = ()) -> Callable[..., Any]:
    return patching.target(owner, name, params, _layout_error)


def _patch(owner: Any, name: str, make: Wrap, params: tuple[str, ...] = ()) -> None:
    patching.patch(owner, name, make, params, _layout_error)


def install() -> None:
    """Hook engine construction (cheap; safe to call more than once, in every vLLM process).
    The output hooks follow when an engine with the ``weightsync`` backend is built."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine

    # The OpenAI server builds its responses over an AsyncLLM; LLMEngine serves ``LLM``.
    _patch(AsyncLLM, "__init__", functools.partial(_constructor, openai=True), ("vllm_config",))
    _patch(LLMEngine, "__init__", functools.partial(_constructor, openai=False), ("vllm_config",))


def _constructor(original: Callable[..., Any], openai: bool) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        config = getattr(self.vllm_config, "weight_transfer_config", None)
        if config is None or getattr(config, "backend", None) != "weightsync":
            return
        processor = getattr(self, "output_processor", None)
        if processor is None or not hasattr(processor, "log_stats"):
            raise _layout_error(f"{type(self).__name__} has no output_processor.log_stats")
        _install_output_hooks()
        if openai:
            from .staleness_openai import install_openai_hooks  # it imports this module

            install_openai_hooks()
        setattr(processor, _ACTIVE, True)
        if not processor.log_stats:
            logger.warning(
                "weightsync: vLLM stats logging is off, so preemptions are not reported: "
                "outputs carry policy_epoch, with kv_cache_epoch and num_evictions None; "
                "drop --disable-log-stats (server) or pass disable_log_stats=False (LLM)"
            )

    return __init__


# --- outputs ---------------------------------------------------------------------------------


def _install_output_hooks() -> None:
    from vllm.outputs import RequestOutput
    from vllm.v1.engine import (
        EngineCoreEventType,
        EngineCoreOutput,
        EngineCoreOutputs,
        FinishReason,
    )
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState

    for struct, name in (
        (EngineCoreOutputs, "weight_version"),
        (EngineCoreOutput, "events"),
        (EngineCoreOutput, "new_token_ids"),
        (EngineCoreOutput, "new_logprobs"),
        (EngineCoreOutput, "finish_reason"),
    ):
        if name not in struct.__struct_fields__:
            raise _layout_error(f"{struct.__name__} has no field {name!r}")
    preempted = getattr(EngineCoreEventType, "PREEMPTED", None)
    if preempted is None:
        raise _layout_error("EngineCoreEventType has no PREEMPTED")

    def add_request(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
            if not getattr(self, _ACTIVE, False):
                return original(self, request, *args, **kwargs)
            # Checked before vLLM registers the request, so a refused one leaves nothing behind.
            max_lag = _max_policy_lag(request.sampling_params)
            original(self, request, *args, **kwargs)
            state = self.request_states.get(request.request_id)
            if state is not None and _TRACKER not in vars(state):
                tracker = EpochTracker(
                    state.prompt_len, events_reported=self.log_stats, max_policy_lag=max_lag
                )
                setattr(state, _TRACKER, tracker)

        return wrapper

    def process_outputs(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not getattr(self, _ACTIVE, False):
                return original(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs).arguments
            outputs, label = bound["engine_core_outputs"], bound.get("weight_version")
            over = _track(self, outputs, label, preempted, FinishReason.ABORT)
            result = original(self, *args, **kwargs)
            # Ended here, so the engine must be told to stop generating them.
            result.reqs_to_abort.extend(over)
            return result

        return wrapper

    def new_completion_output(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            output = original(self, *args, **kwargs)
            tracker: EpochTracker | None = self.__dict__.get(_TRACKER)
            if tracker is not None and output.finish_reason is not None:
                report = tracker.report(self.detokenizer.num_output_tokens())
                for name in FIELDS:
                    setattr(output, name, getattr(report, name))
            return output

        return wrapper

    def add(original: Callable[..., Any]) -> Callable[..., Any]:
        # Merging a streamed delta into an earlier output copies named fields only.
        def wrapper(self: Any, next_output: Any, *args: Any, **kwargs: Any) -> Any:
            original(self, next_output, *args, **kwargs)
            final = {c.index: c for c in next_output.outputs if hasattr(c, FIELDS[0])}
            for completion in self.outputs:
                source = final.get(completion.index)
                if source is not None and source is not completion:
                    for name in FIELDS:
                        setattr(completion, name, getattr(source, name))

        return wrapper

    _patch(OutputProcessor, "add_request", add_request, ("request",))
    _patch(
        OutputProcessor,
        "process_outputs",
        process_outputs,
        ("engine_core_outputs", "weight_version"),
    )
    _patch(RequestState, "_new_completion_output", new_completion_output)
    _patch(RequestOutput, "add", add, ("next_output",))


def _max_policy_lag(sampling_params: Any) -> int | None:
    extra = getattr(sampling_params, "extra_args", None) or {}
    lag = extra.get(MAX_POLICY_LAG_ARG)
    if lag is None:
        return None
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
        raise PolicyLagError(f"{MAX_POLICY_LAG_ARG} must be an integer >= 0, got {lag!r}")
    return lag


def _track(
    processor: Any, outputs: Any, label: str | None, preempted: Any, abort: Any
) -> list[str]:
    """Feed one step's outputs to their requests' trackers; end the requests over their bound
    (before their new tokens, which the newer version sampled). Returns the ids ended."""
    if label is None:
        return []
    try:
        version = version_of_label(label)
    except VersionError as e:
        if label not in _warned_labels:
            _warned_labels.add(label)
            logger.warning("weightsync: no staleness fields for this version: %s", e)
        for output in outputs:
            state = processor.request_states.get(output.request_id)
            if state is not None:
                vars(state).pop(_TRACKER, None)
        return []
    over = []
    for output in outputs:
        state = processor.request_states.get(output.request_id)
        tracker: EpochTracker | None = None if state is None else vars(state).get(_TRACKER)
        if tracker is None:  # aborted, a pooling request, or untracked since a bad label
            continue
        evictions = sum(1 for event in output.events or () if event.type == preempted)
        if output.finish_reason is None and output.new_token_ids and tracker.over_bound(version):
            output.new_token_ids, output.new_logprobs = [], None
            output.finish_reason = abort
            over.append(output.request_id)
        tracker.step(version, len(output.new_token_ids), evictions)
    return over
