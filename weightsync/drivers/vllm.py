"""Drive vLLM servers running the ``weightsync`` backend through vLLM's own HTTP routes, from
the RL framework's process.

The RL framework's one call: :func:`publish_to_vllm` publishes a version to the sender and,
concurrently, has every server pause, apply exactly that version, set its weight version and
resume; it returns once every server serves the version.

The routes are vLLM's RL routes (``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``). An offline
``vllm.LLM`` in the trainer's own process takes a version through :func:`publish_to_llm`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import requests
import torch

from weightsync.errors import ConfigError, ReceiverFailedError, WeightSyncError
from weightsync.manifest import LoraAdapterSpec

if TYPE_CHECKING:
    from weightsync.sender import Publisher, PublishResult


class VllmServerClient:
    """One vLLM server (``base_url`` like ``http://host:8000``) with the weightsync backend.

    Args:
        base_url: the server's root URL.
        timeout_s: HTTP timeout for quick calls; ``apply`` waits up to its own timeout.
        pause_mode: vLLM's ``/pause`` mode during an update: ``"wait"`` lets in-flight
            requests finish on the old weights, ``"abort"`` aborts them, ``"keep"`` freezes
            them and they go on under the new weights (asynchronous RL: their tokens then span
            versions, which ``policy_epoch`` reports; see docs/staleness.md).
        keep_kv: with ``"keep"`` only: keep the KV cache (in-flight requests go on from KV
            computed by the old weights, reported in ``kv_cache_epoch``) instead of clearing
            it (every in-flight request is then evicted and recomputed under the new weights).
            Kept KV includes the prefix cache, so new requests may reuse old-weight prefixes:
            serve with ``--no-enable-prefix-caching`` when that matters.
    """

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 300.0,
        pause_mode: str = "wait",
        keep_kv: bool = False,
    ) -> None:
        if pause_mode not in ("wait", "abort", "keep"):
            raise ConfigError(f"pause_mode must be 'wait', 'abort' or 'keep', got {pause_mode!r}")
        if keep_kv and pause_mode != "keep":
            raise ConfigError(f"keep_kv needs pause_mode='keep', got pause_mode={pause_mode!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.pause_mode = pause_mode
        self.keep_kv = keep_kv

    def _post(self, route: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        # A fresh connection per call: after a failed route vLLM may drop the connection,
        # and a pooled one would swallow the /resume that must follow.
        response = requests.post(
            f"{self.base_url}/{route}",
            timeout=timeout_s or self.timeout_s,
            headers={"Connection": "close"},
            **kwargs,
        )
        if response.status_code != 200:
            raise ReceiverFailedError(
                f"vLLM at {self.base_url}: /{route} answered {response.status_code}: "
                f"{response.text[:500]}"
            )
        return response.json()

    def init(self, sender_address: str, **init_info: Any) -> None:
        """Subscribe every worker of the server to the sender (``WeightsyncInitInfo`` fields)."""
        self._post(
            "init_weight_transfer_engine",
            json={"init_info": {"address": sender_address, **init_info}},
        )

    def apply(self, version: int, timeout_s: float = 600.0) -> None:
        """Pause, apply ``version`` (blocks until it is loaded), set the weight version, resume.

        ``/resume`` is always sent, whatever failed (``/pause`` included).

        Raises:
            ReceiverFailedError: a route failed (the message carries vLLM's answer, e.g. a
                name the model lacks, from every rank); generation is resumed on the previous
                weights.
        """
        try:
            # clear_cache: cached prefixes hold KV computed with the old weights.
            clear_cache = "false" if self.keep_kv else "true"
            self._post("pause", params={"mode": self.pause_mode, "clear_cache": clear_cache})
            self._post("start_weight_update")
            try:
                self._post(
                    "update_weights",
                    timeout_s=timeout_s + self.timeout_s,
                    json={"update_info": {"version": version, "timeout_s": timeout_s}},
                )
            except ReceiverFailedError:
                self._end_failed_session()
                raise
            self._post("finish_weight_update", json={"weight_version": str(version)})
        except BaseException as e:
            try:
                self._post("resume")
            except (ReceiverFailedError, requests.RequestException) as resume_error:
                e.add_note(f"/resume failed too: {resume_error}")
            raise
        self._post("resume")

    def _end_failed_session(self) -> None:
        """End vLLM's update session on the ranks still in it, keeping the weight version.

        With several workers only the last rank raised (see ``receiver.vllm.engine``); the
        others' session is still open and the next ``/start_weight_update`` would fail on
        them. The ranks whose session the failure ended answer that none is open: expected.
        """
        try:
            self._post("finish_weight_update")
        except (ReceiverFailedError, requests.RequestException):
            pass

    def weight_version(self) -> str:
        response = requests.get(f"{self.base_url}/weight_info", timeout=self.timeout_s)
        response.raise_for_status()
        return response.json()["weight_version"]


def publish_to_vllm(
    publisher: Publisher,
    tensors: Mapping[str, torch.Tensor],
    version: int,
    servers: Sequence[VllmServerClient],
    *,
    lora: LoraAdapterSpec | None = None,
    timeout_s: float = 600.0,
) -> PublishResult:
    """Publish ``version`` and return only once every server serves it.

    Args:
        publisher: connected to the sender.
        tensors: the version's HF-named tensors.
        version: the version number (greater than the last).
        servers: the vLLM servers to update (each ``init``-ed against the same sender).
        lora: the LoRA adapter shipped with the version, if any.

    Returns:
        What ``publisher.publish(..., wait=True)`` returns.

    Raises:
        ReceiverFailedError: a server failed to apply the version.
    """
    with ThreadPoolExecutor(max_workers=len(servers) + 1) as pool:
        applying = [pool.submit(s.apply, version, timeout_s) for s in servers]
        published = pool.submit(
            publisher.publish, tensors, version, lora=lora, wait=True, timeout_s=timeout_s
        )
        failures = [f.exception() for f in applying if f.exception() is not None]
        try:
            result = published.result()
        except WeightSyncError as e:
            if not failures:
                raise
            # vLLM answers a failed route with a bare 500; the sender knows why.
            servers_say = "; ".join(str(f) for f in failures)
            raise ReceiverFailedError(f"{servers_say}; the sender reports: {e}") from e
    if failures:
        raise failures[0]
    return result


def publish_to_llm(
    publisher: Publisher,
    tensors: Mapping[str, torch.Tensor],
    version: int,
    llm: Any,
    *,
    lora: LoraAdapterSpec | None = None,
    timeout_s: float = 600.0,
) -> PublishResult:
    """Publish ``version`` while an offline ``vllm.LLM`` of this process (started with
    ``weight_transfer_config={"backend": "weightsync"}`` and ``init_weight_transfer_engine``-ed
    against the same sender) applies it through vLLM's RL calls; return once it serves it.

    Returns:
        What ``publisher.publish(..., wait=True)`` returns.

    Raises:
        What the publish raised (the sender names each receiver that failed and why), else
        what the engine raised.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        published = pool.submit(
            publisher.publish, tensors, version, lora=lora, wait=True, timeout_s=timeout_s
        )
        try:
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": version}})
            llm.finish_weight_update(weight_version=str(version))
        except Exception:
            published.result()  # the sender's account names the tensor; else the engine's
            raise
        return published.result()
