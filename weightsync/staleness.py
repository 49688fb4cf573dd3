"""Per-token staleness: which weights version sampled each token and computed each KV entry.

The fields have Megatron Inference's names and shapes, so an RL framework reading one engine
reads the other:

- ``policy_epoch``: run-length list of ``(token_index, version)`` over the generated tokens;
  each pair says "from this output token on, tokens were sampled under ``version``".
- ``kv_cache_epoch``: the same over positions ``0 .. prompt_len + num_tokens - 2`` (prompt
  first, then generated tokens): the version whose weights computed each position's KV entries.
  The last sampled token has no KV entry (it was never fed back).
- ``num_evictions``: how many times the request was preempted and its KV recomputed.

Everything here is pure bookkeeping (no engine, no I/O): :class:`EpochTracker` follows one
request from the engine's per-step outputs; the RL-side helpers expand runs to per-token
versions and apply a staleness bound.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from weightsync.errors import VersionError

Runs = list[tuple[int, int]]
"""``[(start_index, version), ...]``: starts strictly increasing from 0, neighbours differ."""

INITIAL_LABEL = "default"
"""vLLM's weight-version label before any ``finish_weight_update``: the checkpoint, version 0."""


def version_of_label(label: str) -> int:
    """Our applied version from an engine's weight-version label (``str(version)``).

    Raises:
        VersionError: the label is neither an integer nor the engine's initial label; set it
            with ``finish_weight_update(weight_version=str(version))`` as the drivers do.
    """
    if label == INITIAL_LABEL:
        return 0
    try:
        return int(label)
    except ValueError:
        raise VersionError(
            f"weight version label {label!r} is not a weightsync version; finish each update "
            "with weight_version=str(version) (as weightsync.drivers.vllm does)"
        ) from None


def extend_runs(runs: Runs, length: int, start: int, end: int, version: int) -> int:
    """Set indexes ``[start, end)`` of a run list covering ``[0, length)`` to ``version``.

    Everything from ``start`` on is replaced (a recompute rewrites a suffix, an append extends
    it); ``start`` must not leave a gap. Returns the new covered length, ``end``.
    """
    if not 0 <= start <= length or end < start:
        raise ValueError(f"cannot set [{start}, {end}) of runs covering [0, {length})")
    while runs and runs[-1][0] >= start:
        runs.pop()
    if end > start and (not runs or runs[-1][1] != version):
        runs.append((start, version))
    return end


def truncate_runs(runs: Runs, length: int) -> Runs:
    """The runs restricted to ``[0, length)``."""
    return [(start, version) for start, version in runs if start < length]


def run_length(values: Iterable[int]) -> Runs:
    """The runs of one version per index (the inverse of :func:`expand_runs`)."""
    runs: Runs = []
    for index, value in enumerate(values):
        if not runs or runs[-1][1] != value:
            runs.append((index, value))
    return runs


def expand_runs(runs: Sequence[Sequence[int]], length: int) -> list[int]:
    """One version per index of ``[0, length)``: the form importance weighting consumes.

    Raises:
        ValueError: the runs do not start at 0 or are not strictly increasing (a malformed
            field, e.g. from another engine's response).
    """
    if length == 0:
        return []
    if not runs or runs[0][0] != 0:
        raise ValueError(f"runs must start at index 0, got {list(runs)!r}")
    out: list[int] = []
    bounds = [int(r[0]) for r in runs[1:]] + [length]
    for (start, version), end in zip(runs, bounds, strict=True):
        if end <= start:
            raise ValueError(f"run starts must increase, got {list(runs)!r}")
        out.extend([int(version)] * (min(end, length) - start))
        if end >= length:
            break
    return out


@dataclass(frozen=True)
class Staleness:
    """The three fields for one output choice."""

    policy_epoch: Runs
    kv_cache_epoch: Runs | None
    """None when the engine does not report preemptions (vLLM with stats logging off)."""
    num_evictions: int | None

    def as_dict(self) -> dict[str, object]:
        return {
            "policy_epoch": [list(r) for r in self.policy_epoch],
            "kv_cache_epoch": (
                None if self.kv_cache_epoch is None else [list(r) for r in self.kv_cache_epoch]
            ),
            "num_evictions": self.num_evictions,
        }


@dataclass
class EpochTracker:
    """One request's versions, fed one engine step output at a time.

    Rules (the engine's step loop is paused while weights change, so each step ran under
    exactly one version, the one it reports):

    - tokens sampled in a step are under that step's version;
    - a step computes KV for every known position not yet computed: the whole prompt (and, after
      an eviction, every generated token so far) at the first step, then the previous token;
    - an eviction drops the request's KV; the next step recomputes all of it.
    """

    prompt_len: int
    events_reported: bool = True
    """False when the engine sends no preemption events: kv and evictions are then unknown."""
    max_policy_lag: int | None = None
    """The staleness bound, if the request asked for one (see :meth:`over_bound`)."""
    policy: Runs = field(default_factory=list)
    kv: Runs = field(default_factory=list)
    num_tokens: int = 0
    num_kv: int = 0
    num_evictions: int = 0
    _evicted: bool = True

    def step(self, version: int, num_new_tokens: int, num_evictions: int = 0) -> None:
        """Record one engine output for the request: ``num_new_tokens`` sampled under
        ``version``; ``num_evictions`` preemptions reported with it (they precede its tokens)."""
        if num_evictions:
            self.num_evictions += num_evictions
            self._evicted = True
        if num_new_tokens <= 0:
            return
        # The step's input was every token known before it, less the one it just sampled.
        kv_end = self.prompt_len + self.num_tokens + num_new_tokens - 1
        kv_start = 0 if self._evicted else self.num_kv
        self.num_kv = extend_runs(self.kv, self.num_kv, kv_start, kv_end, version)
        self._evicted = False
        self.num_tokens = extend_runs(
            self.policy, self.num_tokens, self.num_tokens, self.num_tokens + num_new_tokens, version
        )

    def over_bound(self, version: int) -> bool:
        """Whether sampling under ``version`` would put the request's oldest token more than
        ``max_policy_lag`` versions behind (the engine then ends the request instead)."""
        oldest = oldest_version(self.policy)
        return (
            self.max_policy_lag is not None
            and oldest is not None
            and version - oldest > self.max_policy_lag
        )

    def report(self, num_tokens: int | None = None) -> Staleness:
        """The fields for the output's first ``num_tokens`` tokens (the engine may drop surplus
        tokens after a stop string); default: every token seen."""
        n = self.num_tokens if num_tokens is None else min(num_tokens, self.num_tokens)
        if not self.events_reported:
            return Staleness(truncate_runs(self.policy, n), None, None)
        return Staleness(
            truncate_runs(self.policy, n),
            truncate_runs(self.kv, self.prompt_len + n - 1 if n else 0),
            self.num_evictions,
        )


_SPAN_KEYS = ("start", "end", "version")


def policy_epoch_from_spans(spans: Iterable[object]) -> Runs:
    """``policy_epoch`` from an engine's own weight-version spans: SGLang's
    ``meta_info["weight_versions"]`` (dicts with ``version``, ``start``, ``end``; its OpenAI
    responses carry them in ``metadata``) or vLLM's ``CompletionOutput.weight_versions``
    (objects with those attributes). Labels are read as :func:`version_of_label` does.

    Raises:
        VersionError: a label is not a weightsync version.
        ValueError: the spans leave a gap or overlap.
    """
    runs: Runs = []
    end = 0
    for span in spans:
        start, stop, label = (
            (span[k] for k in _SPAN_KEYS)
            if isinstance(span, dict)
            else (getattr(span, k) for k in _SPAN_KEYS)
        )
        if start != end:
            raise ValueError(
                f"weight-version spans must be contiguous from 0: {span!r} starts at {start}, "
                f"expected {end}"
            )
        if stop > start:
            end = extend_runs(runs, end, start, stop, version_of_label(label))
    return runs


# --- the RL side ------------------------------------------------------------------------------


def behaviour_versions(policy_epoch: Sequence[Sequence[int]], num_tokens: int) -> list[int]:
    """Per generated token, the version of the behaviour policy that sampled it; pair it with
    the token's logprob to importance-weight against the version being trained."""
    return expand_runs(policy_epoch, num_tokens)


def oldest_version(policy_epoch: Sequence[Sequence[int]]) -> int | None:
    """The oldest version any token was sampled under (None for no tokens)."""
    return min((int(v) for _, v in policy_epoch), default=None)


@dataclass(frozen=True)
class StaleChoice:
    """A choice whose oldest token is more than the bound behind."""

    key: object
    oldest_version: int
    lag: int


def stale_choices(
    choices: Iterable[tuple[object, Sequence[Sequence[int]]]], current_version: int, max_lag: int
) -> list[StaleChoice]:
    """The choices whose oldest sampled token is more than ``max_lag`` versions behind
    ``current_version``; ``choices`` are ``(key, policy_epoch)`` pairs (key: anything the caller
    uses to find the choice again, e.g. ``(request_id, index)``)."""
    if max_lag < 0:
        raise ValueError(f"max_lag must be >= 0, got {max_lag}")
    stale = []
    for key, policy_epoch in choices:
        oldest = oldest_version(policy_epoch)
        if oldest is not None and current_version - oldest > max_lag:
            stale.append(StaleChoice(key, oldest, current_version - oldest))
    return stale
