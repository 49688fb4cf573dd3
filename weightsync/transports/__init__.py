"""Data-plane transports behind one interface, looked up by name."""

from __future__ import annotations

import torch

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


__all__ = ["MappedBuffers", "StagingBuffer", "Transport", "get_transport", "resolve_transport"]
