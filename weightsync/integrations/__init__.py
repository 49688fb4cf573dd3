"""Adapters that plug weightsync into RL frameworks through the framework's own extension point.

They run in the framework's processes (like :mod:`weightsync.drivers`) and sit on top of the
sender and the receivers:

- :mod:`.verl`: a verl checkpoint-engine backend named ``weightsync`` (verl's
  ``CheckpointEngineRegistry``, loaded by ``checkpoint_engine.custom_backend_module``).
  Needs verl installed; tested against verl 0.9.1.
- :mod:`.slime`: a slime weight updater (Megatron ranks publish with ``MegatronPublisher``,
  rank 0 drives the SGLang engines), installed through slime's ``--custom-megatron-init-path``.
  Written against slime's published source (no slime import).
- :mod:`.ray`: one sender per node of a Ray placement group; workers get their node's
  address (needs ray; tested with 2.60).
- :mod:`.stream`: what both build on: receive one version as a stream of ``(name, tensor)``
  pairs, for frameworks that load weights themselves.
"""
