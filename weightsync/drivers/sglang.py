"""Drive one weight version through a running SGLang server over its HTTP API (SGLang 0.5.23
routes, from ``sglang/srt/entrypoints/http_server.py``), from the RL framework's process.
It needs no SGLang: requests go through the standard library.

One version, in order (optional steps in brackets)::

    [POST /pause_generation {"mode"}]            abort | retract ("wait") | in_place ("keep")
    [POST /release_memory_occupation {"tags": ["kv_cache"]}]
    POST /begin_weight_update {"selector"}       SGLang refuses updates outside this session
    POST /update_weights_from_tensor             load_format = the worker hook; the workers
                                                 receive the bytes from weightsync's sender
    POST /end_weight_update {}
    [POST /resume_memory_occupation {"tags": ["kv_cache"]}]
    [POST /flush_cache]                          the prefix cache holds KV of the old weights
                                                 (not with KEEP: SGLang refuses while requests
                                                 run; their KV stays the old version's)
    POST /update_weight_version {"new_version"}
    [POST /continue_generation {}]

A failure before the update step undoes what was done (end the session, resume the KV cache,
continue generation) so the server keeps serving the previous weights; the error names the
step. A failed update step closes the session and gives the KV cache back but leaves generation
PAUSED: the workers may have written part of the version (a version rejected at validation
wrote nothing; the server's message, included in the error, says which). A failure after the
update leaves generation paused too, rather than serve tokens whose cache or version label is
wrong. ``SglangUpdateError.weights_changed`` tells the two cases apart.
"""

from __future__ import annotations

import base64
import enum
import json
import pickle
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightsync.errors import ConfigError, WeightSyncError
from weightsync.receiver.sglang.hook import HOOK_PATH

if TYPE_CHECKING:
    import torch

    from weightsync.manifest import LoraAdapterSpec
    from weightsync.sender.publisher import Publisher, PublishResult


class PauseMode(enum.Enum):
    """What happens to in-flight requests while the weights change (SGLang's pause modes)."""

    ABORT = "abort"
    """Abort them; they return to the caller unfinished."""
    WAIT = "retract"
    """They wait in the queue and are recomputed with the new weights after the update."""
    KEEP = "in_place"
    """They stay in the running batch with their KV (computed with the old weights); the prefix
    cache is not flushed (SGLang refuses while requests run), so new requests may reuse prefixes
    the old weights computed (``kv_cache_epoch`` reports them)."""


class SglangUpdateError(WeightSyncError):
    """One step of driving an update failed; ``step`` names it."""

    def __init__(self, step: str, message: str, *, weights_changed: bool) -> None:
        state = (
            "the server holds the NEW weights (possibly partly written) and generation stays "
            "paused; fix the cause and run the version again"
            if weights_changed
            else "the server keeps serving the previous weights"
        )
        super().__init__(f"SGLang step {step!r} failed: {message}; {state}")
        self.step = step
        self.weights_changed = weights_changed


@dataclass(frozen=True)
class SglangHttpClient:
    """Drives weight updates of the SGLang server at ``base_url``.

    Args:
        base_url: e.g. ``http://127.0.0.1:30000``.
        tp_size: the server's ``--tp-size``; one (empty) payload is sent per TP rank.
        pause: pause generation during the update (None: do not pause).
        release_kv_cache: free the KV cache during the update (memory for colocated
            trainers); needs ``pause`` ABORT or WAIT (SGLang releases only an idle engine).
        api_key: the server's admin or API key, sent as a bearer token.
        timeout_s: per request; the update step waits for the whole version.
    """

    base_url: str
    tp_size: int = 1
    pause: PauseMode | None = PauseMode.WAIT
    release_kv_cache: bool = False
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ConfigError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.release_kv_cache and self.pause not in (PauseMode.ABORT, PauseMode.WAIT):
            raise ConfigError(
                "release_kv_cache needs pause=PauseMode.ABORT or PauseMode.WAIT: SGLang frees "
                "the KV cache only when no request is running"
            )

    def _post(self, route: str, body: dict) -> None:
        request = urllib.request.Request(
            self.base_url.rstrip("/") + route,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}
            | ({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}),
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as e:
            raise _StepFailed(f"HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from e
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise _StepFailed(f"{self.base_url} unreachable: {e}") from e
        # Routes that answer {"success": false} with status 200 would otherwise pass.
        try:
            content = json.loads(payload) if payload else None
        except json.JSONDecodeError:
            return
        if isinstance(content, dict) and content.get("success") is False:
            raise _StepFailed(str(content.get("message", content)))

    def update(
        self,
        version: int,
        *,
        selector: str = "target",
        applied: Callable[[], object] | None = None,
    ) -> None:
        """Apply ``version`` (published to weightsync's sender) to the server.

        Args:
            version: becomes the server's ``weight_version``.
            selector: which runners load it (``"target"``: not the draft model).
            applied: called once the workers' update returned and before anything else;
                raises if the sender says the version failed (:func:`publish_to_sglang`
                passes the publish's result). The workers' hook returns normally from a
                version it refused without writing (SGLang's scheduler would exit on an
                exception), so SGLang answers such an update as a success; without
                ``applied`` the version would be labelled on weights that did not change.

        Raises:
            SglangUpdateError: a step failed; ``.step`` names it, ``.weights_changed`` says
                whether the server still serves the previous weights.
        """
        undo: list[tuple[str, str, dict]] = []  # (step, route, body), run newest first
        try:
            if self.pause is not None:
                self._step("pause_generation", "/pause_generation", {"mode": self.pause.value})
                undo.append(("continue_generation", "/continue_generation", {}))
            if self.release_kv_cache:
                self._step("release_kv_cache", "/release_memory_occupation", _KV)
                undo.append(("resume_kv_cache", "/resume_memory_occupation", _KV))
            self._step("begin_weight_update", "/begin_weight_update", {"selector": selector})
            undo.append(("end_weight_update", "/end_weight_update", {}))
        except _StepFailedAt as e:
            self._undo(undo)
            raise SglangUpdateError(e.step, e.message, weights_changed=False) from e.__cause__
        try:
            self._step(
                "update_weights",
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [_EMPTY_PAYLOAD] * self.tp_size,
                    "load_format": HOOK_PATH,
                    "flush_cache": False,  # its own step below, so a failure names it
                    "selector": selector,
                },
            )
        except _StepFailedAt as e:
            # Close the session and give the KV cache back, but do not resume generation:
            # the weights may be partly written.
            self._undo([u for u in undo if u[0] != "continue_generation"])
            raise SglangUpdateError(e.step, e.message, weights_changed=True) from e.__cause__
        if applied is not None:
            try:
                applied()
            except WeightSyncError as e:
                # The hook answered success: its workers wrote nothing (one that had written
                # raises, and SGLang exits), so the server serves the previous weights.
                self._undo(undo)
                raise SglangUpdateError(
                    "update_weights", f"the sender reports: {e}", weights_changed=False
                ) from e
        try:
            self._step("end_weight_update", "/end_weight_update", {})
            if self.release_kv_cache:
                self._step("resume_kv_cache", "/resume_memory_occupation", _KV)
            if self.pause is not PauseMode.KEEP:
                # SGLang flushes only with no request running; kept requests still are, and the
                # radix cache keeps their old-version KV (kv_cache_epoch says so).
                self._step("flush_cache", "/flush_cache", {})
            self._step(
                "set_weight_version",
                "/update_weight_version",
                {"new_version": str(version), "abort_all_requests": False},
            )
            if self.pause is not None:
                self._step("continue_generation", "/continue_generation", {})
        except _StepFailedAt as e:
            raise SglangUpdateError(e.step, e.message, weights_changed=True) from e.__cause__

    def _step(self, step: str, route: str, body: dict) -> None:
        try:
            self._post(route, body)
        except _StepFailed as e:
            raise _StepFailedAt(step, str(e)) from e

    def _undo(self, undo: list[tuple[str, str, dict]]) -> None:
        # Best effort, newest first: each undo is independent of the others succeeding.
        for _step, route, body in reversed(undo):
            try:
                self._post(route, body)
            except _StepFailed:
                continue


def publish_to_sglang(
    publisher: Publisher,
    tensors: Mapping[str, torch.Tensor],
    version: int,
    servers: Sequence[SglangHttpClient],
    *,
    lora: LoraAdapterSpec | None = None,
    timeout_s: float = 600.0,
) -> PublishResult:
    """Publish ``version`` and return only once every server serves it, labelled.

    Each server's update runs beside the publish; a server labels the version (and resumes
    generation) only after the sender reports that every receiver applied it.

    Args:
        publisher: connected to the sender the servers' workers registered with (their first
            update registers them: publish version 1 only once they have).
        tensors: the version's HF-named tensors.
        version: the version number (greater than the last).
        servers: the SGLang servers to update.
        lora: the LoRA adapter shipped with the version, if any.

    Returns:
        What ``publisher.publish(..., wait=True)`` returns.

    Raises:
        SglangUpdateError: a server's step failed, or the sender reports the version failed
            (``weights_changed`` False: the workers that failed kept their previous weights;
            with TP > 1 each worker commits on its own, and the sender's report names the
            ones that failed).
        WeightSyncError: the publish itself failed.
    """
    with ThreadPoolExecutor(max_workers=len(servers) + 1) as pool:
        published = pool.submit(
            publisher.publish, tensors, version, lora=lora, wait=True, timeout_s=timeout_s
        )
        updating = [pool.submit(s.update, version, applied=published.result) for s in servers]
        failures = [f.exception() for f in updating if f.exception() is not None]
    if failures:
        raise failures[0]
    return published.result()


_KV = {"tags": ["kv_cache"]}
# pickle of an empty list (what SGLang's MultiprocessingSerializer makes of []), base64 for JSON.
_EMPTY_PAYLOAD = base64.b64encode(pickle.dumps([])).decode()


class _StepFailed(Exception):
    """A request failed (internal: turned into SglangUpdateError with the step's name)."""


class _StepFailedAt(Exception):
    def __init__(self, step: str, message: str) -> None:
        super().__init__(step, message)
        self.step = step
        self.message = message
