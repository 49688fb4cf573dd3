"""SGLang general-plugin entry point (``sglang.srt.plugins``: ``weightsync``): SGLang calls
:func:`register` at the start of each of its processes (the engine or HTTP server, every
scheduler, the detokenizer), before it builds anything.

- Staleness (``weightsync.receiver.sglang.staleness``): engines running weightsync's weight
  loader report ``policy_epoch``, ``kv_cache_epoch`` and ``num_evictions`` in ``meta_info``.

SGLang loads every installed general plugin unless ``SGLANG_PLUGINS`` lists the ones to load;
where it is set, include ``weightsync``. SGLang logs and skips a plugin that raises, so a
SGLang whose layout moved fails later, at scheduler startup, where the hooks check it.
"""

from __future__ import annotations


def register() -> None:
    """Install the hooks (idempotent; cheap: patches classes already imported)."""
    from weightsync.receiver.sglang.staleness import install

    install()
