"""Data-plane transports behind one interface, looked up by name."""

from __future__ import annotations

import torch

from weightsync.registry import Registry
from weightsync.transports.base import MappedBuffers, StagingBuffer, Transport

TRANSPORTS: Registry[type[Transport]] = Registry(
    "transport",
    {
        "shm": "weightsync.transports.shm:ShmTransport",
        "cuda_ipc": "weightsync.transports.cuda_ipc:CudaIpcTransport",
    },
)

_instances: dict[str, Transport] = {}


def get_transport(name: str) -> Transport:
    """The process-wide instance of transport ``name`` ("shm", "cuda_ipc")."""
    if name not in _instances:
        _instances[name] = TRANSPORTS.get(name)()
    return _instances[name]


def resolve_transport(name: str, device: torch.device) -> str:
    """The staging transport: ``cuda_ipc`` for CUDA tensors, ``shm`` for CPU ones.

    ``auto`` and ``nccl`` pick by device (``nccl`` broadcasts *from* that staging); ``shm`` and
    ``cuda_ipc`` are taken as given.
    """
    if name in ("auto", "nccl"):
        return "cuda_ipc" if device.type == "cuda" else "shm"
    TRANSPORTS.get(name)
    return name


__all__ = ["MappedBuffers", "StagingBuffer", "Transport", "get_transport", "resolve_transport"]
