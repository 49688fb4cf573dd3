"""LoRA adapters into an SGLang worker through SGLang's tensor adapter loading.

SGLang 0.5's ``LoRAManager.load_lora_adapter_from_tensors(lora_ref, tensors, config_dict)``
loads an adapter from memory; the tokenizer side routes a request's ``lora_path`` (the adapter
name) to a ``LoRARef.lora_id`` it registered. So the loader replaces an adapter IN PLACE under
the same ``LoRARef`` (unload, then load with the identical ref): the tokenizer's registry
keeps pointing at it and requests by name keep working across versions. The prefix cache keys
on that id too, so flush it after the version (``SglangHttpClient`` does).

The first version of an adapter must therefore find it registered on the tokenizer side:
launch the server with ``--lora-paths NAME=PATH`` (any PEFT adapter of the same shape, e.g.
the initial one) or call ``/load_lora_adapter`` once before the first sync. An adapter the
worker has never seen is loaded under a fresh ref, usable by the worker but not routable by
name until the tokenizer learns it. With ``--max-loaded-loras``, loading other adapters can
evict (unregister) it on the tokenizer side, with the same effect; pin it or leave that unset.

Tested in a real offline ``sglang.Engine`` on CPU (tests/sglang/test_engine_hook.py, through
the hook); the call sequence and failure reporting also against a stand-in manager
(tests/sglang/test_sglang_api.py).
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync.errors import ManifestMismatchError, ReceiverFailedError
from weightsync.manifest import LoraAdapterSpec


class SglangLoraLoader:
    """Loads completed adapters into a worker's ``LoRAManager`` (``model_runner.lora_manager``)."""

    def __init__(self, lora_manager: Any) -> None:
        self.lora_manager = lora_manager

    def validate(self, spec: LoraAdapterSpec) -> None:
        """What SGLang's LoRA memory pool would refuse (``can_support``), refused before any
        write: a rank above ``--max-lora-rank``, a target module its layers do not wrap."""
        config = spec.config
        max_rank = getattr(self.lora_manager, "max_lora_rank", None)
        rank = config.get("r")
        if isinstance(max_rank, int) and isinstance(rank, int) and rank > max_rank:
            raise ManifestMismatchError(
                f"LoRA adapter {spec.name!r} has rank {rank} but the server was launched with "
                f"--max-lora-rank {max_rank}; relaunch with a larger --max-lora-rank"
            )
        served = getattr(self.lora_manager, "target_modules", None)
        targets = config.get("target_modules")
        if isinstance(served, set) and isinstance(targets, list):
            from sglang.srt.lora.utils import get_normalized_target_modules

            wanted = get_normalized_target_modules(targets)
            missing = set() if "all" in wanted else wanted - served
            if missing:
                raise ManifestMismatchError(
                    f"LoRA adapter {spec.name!r} targets {sorted(missing)}, which the server's "
                    f"LoRA layers do not wrap (they wrap {sorted(served)}); relaunch with "
                    "--lora-target-modules including them"
                )

    def _existing_ref(self, name: str) -> Any | None:
        for ref in self.lora_manager.lora_refs.values():
            if ref.lora_name == name:
                return ref
        return None

    def load(self, spec: LoraAdapterSpec, tensors: dict[str, torch.Tensor], version: int) -> None:
        from sglang.srt.lora.lora_registry import LoRARef

        ref = self._existing_ref(spec.name)
        if ref is not None:
            self._check(self.lora_manager.unload_lora_adapter(ref), spec, "unload the old")
        else:
            ref = LoRARef(lora_name=spec.name, lora_path=f"weightsync://{spec.name}")
        result = self.lora_manager.load_lora_adapter_from_tensors(ref, tensors, spec.config)
        self._check(result, spec, f"load version {version} of the")

    @staticmethod
    def _check(result: Any, spec: LoraAdapterSpec, what: str) -> None:
        if not getattr(result, "success", False):
            raise ReceiverFailedError(
                f"SGLang could not {what} LoRA adapter {spec.name!r}: "
                f"{getattr(result, 'error_message', result)}"
            )
