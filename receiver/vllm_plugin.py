"""vLLM ``general_plugins`` entry point: registers the ``weightsync`` weight-transfer backend.

vLLM calls :func:`register` in its main, EngineCore and worker processes, so
``--weight-transfer-config '{"backend": "weightsync"}'`` works with the multiprocess engine.
"""

from __future__ import annotations


def register() -> None:
    """Register the backend; a no-op when vLLM has no weight-transfer registry (< 0.30)."""
    try:
        from weightsync.receiver.vllm.engine import register_engine
    except ImportError:
        return
    register_engine()
