"""The vLLM receiver: a ``WeightTarget`` for a vLLM worker and the ``weightsync`` backend of
vLLM's weight-transfer engine registry."""

from weightsync.receiver.vllm.lora_store import adapter_path, lora_id, lora_request
from weightsync.receiver.vllm.target import VllmWeightTarget, loading_view

__all__ = ["VllmWeightTarget", "adapter_path", "loading_view", "lora_id", "lora_request"]
