"""Data-plane transports behind one interface, looked up by name."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weightsync.buckets import TensorSpec, align_up
from weightsync.config import ALIGNMENT_BYTES
from weightsync.errors import ConfigError
from weightsync.transports.base import MappedBuffers, StagingBuffer, Transport
from weightsync.transports.cuda_ipc import CudaIpcTransport
from weightsync.transports.shm import ShmTransport

_CLASSES: dict[str, type[Transport]] = {"cuda_ipc": CudaIpcTransport, "shm": ShmTransport}

_instances: dict[str, Transport] = {}
"""One instance per transport name for the whole process, made on first use; never dropped."""


def _class_of(name: str) -> type[Transport]:
    try:
        return _CLASSES[name]
    except KeyError:
        raise ConfigError(f"unknown transport {name!r}; known: {', '.join(_CLASSES)}") from None


def get_transport(name: str) -> Transport:
    """The process-wide instance of transport ``name`` ("shm", "cuda_ipc")."""
    if name not in _instances:
        _instances[name] = _class_of(name)()
    return _instances[name]


def resolve_transport(name: str, device: torch.device) -> str:
    """The staging transport: ``cuda_ipc`` for CUDA tensors, ``shm`` for CPU ones.

    ``auto`` and ``nccl`` pick by device (``nccl`` broadcasts *from* that staging); ``shm`` and
    ``cuda_ipc`` are taken as given.
    """
    if name in ("auto", "nccl"):
        return "cuda_ipc" if device.type == "cuda" else "shm"
    _class_of(name)
    return name


def shm_tensors(specs: Sequence[TensorSpec]) -> tuple[StagingBuffer, dict[str, torch.Tensor]]:
    """Tensors shaped as ``specs``, in one shm buffer this process allocates, each at a
    256-byte aligned offset. A CPU trainer that keeps its weights there offers them to a sender
    on its host, which maps them and packs every bucket itself (and can slice them), as it
    does CUDA memory. Release the buffer with ``get_transport("shm").release``."""
    sizes = [align_up(s.nbytes) for s in specs]
    store = get_transport("shm").allocate(max(sum(sizes), ALIGNMENT_BYTES), torch.device("cpu"))
    tensors, offset = {}, 0
    for spec, size in zip(specs, sizes, strict=True):
        raw = store.tensor[offset : offset + spec.nbytes]
        tensors[spec.name] = raw.view(spec.torch_dtype).view(spec.shape)
        offset += size
    return store, tensors


__all__ = [
    "MappedBuffers",
    "StagingBuffer",
    "Transport",
    "get_transport",
    "resolve_transport",
    "shm_tensors",
]
