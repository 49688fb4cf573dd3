"""vLLM ``general_plugins`` entry point: registers the ``weightsync`` weight-transfer backend on
both sides of vLLM's weight transfer.

- Engine side (``WeightTransferEngineFactory``): ``weightsync.receiver.vllm.engine``, so
  ``--weight-transfer-config '{"backend": "weightsync"}'`` works. vLLM calls :func:`register`
  in its main, EngineCore and worker processes, so this covers the multiprocess engine.
- Trainer side (``WeightTransferTrainerFactory``): ``weightsync.drivers.vllm_trainer``, so
  ``WeightTransferTrainerFactory.trainer_init(WeightsyncTrainerInitInfo(...), ...)`` works.
  Registered by module path (imported only when used); importing
  ``weightsync.drivers.vllm_trainer`` registers it too, for trainer processes where vLLM never
  loads its plugins.

- The default LoRA directory (``lora_store.default_lora_dir``): made here in vLLM's main process,
  which loads its plugins (``EngineArgs.__post_init__``) before it starts the engine core and
  the workers, and exported as ``$WEIGHTSYNC_LORA_DIR``, so that the path the main process
  puts in a ``lora_request`` is the one the workers write to.

- Staleness (``weightsync.receiver.vllm.staleness``): engines with the ``weightsync`` backend
  report ``policy_epoch``, ``kv_cache_epoch`` and ``num_evictions`` in their outputs.

Both registrations are idempotent: vLLM loads plugins more than once per process and its
registries raise on a duplicate name.
"""

from __future__ import annotations

BACKEND_NAME = "weightsync"
TRAINER_MODULE = "weightsync.drivers.vllm_trainer"
TRAINER_CLASS = "WeightsyncTrainerEngine"


def register() -> None:
    """Register both sides; a no-op when vLLM has no weight-transfer registry (< 0.30)."""
    try:
        from weightsync.receiver.vllm.engine import register_engine
    except ImportError:
        return
    from weightsync.receiver.vllm.lora_store import default_lora_dir
    from weightsync.receiver.vllm.staleness import install as install_staleness_hooks

    default_lora_dir()  # before the engine's processes start: they inherit it
    register_engine()
    register_trainer_engine()
    install_staleness_hooks()


def register_trainer_engine() -> None:
    """Register the trainer-side engine by module path; safe to call more than once, and a
    no-op on vLLM without a trainer-side registry."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:
        return
    try:
        WeightTransferTrainerFactory.register_engine(BACKEND_NAME, TRAINER_MODULE, TRAINER_CLASS)
    except ValueError as e:
        if "already registered" not in str(e):
            raise
