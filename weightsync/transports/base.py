"""The data-plane interface: staging buffers the sender owns, mapped by packers and receivers."""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from weightsync.v1 import weightsync_pb2 as pb

# Buffers this process allocated or exported. A process cannot open its own CUDA IPC handle,
# and a publisher may well share its process with an embedded ``Sender``. Weak: an entry
# lives as long as its owner holds the tensor.
_OWN: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


# The handles of buffers this process allocated, by their storage's address: a tensor that
# lives in one can be offered to the sender by that handle.
_OWN_HANDLES: dict[int, pb.BufferHandle] = {}


def register_own(buffer_id: str, tensor: torch.Tensor) -> None:
    """Let this process "map" ``tensor`` by ``buffer_id`` while its owner holds it."""
    _OWN[buffer_id] = tensor


def own_handle(tensor: torch.Tensor) -> pb.BufferHandle | None:
    """The handle of the allocated buffer ``tensor`` lives in, if this process made one."""
    return _OWN_HANDLES.get(tensor.untyped_storage().data_ptr())


@dataclass
class StagingBuffer:
    """A flat uint8 buffer owned by the sender; ``handle`` lets other processes map it."""

    buffer_id: str
    tensor: torch.Tensor
    handle: pb.BufferHandle

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()


class Transport(ABC):
    """Allocates staging buffers (sender side) and maps them (publisher and receiver side)."""

    name: ClassVar[str]

    def allocate(self, nbytes: int, device: torch.device) -> StagingBuffer:
        """Create a buffer of ``nbytes`` that other processes on this host can map."""
        buffer = self._allocate(nbytes, device)
        register_own(buffer.buffer_id, buffer.tensor)
        _OWN_HANDLES[buffer.tensor.untyped_storage().data_ptr()] = buffer.handle
        return buffer

    def release(self, buffer: StagingBuffer) -> None:
        """Free a buffer this process allocated. Mappings elsewhere stay valid until closed."""
        _OWN.pop(buffer.buffer_id, None)
        _OWN_HANDLES.pop(buffer.tensor.untyped_storage().data_ptr(), None)
        self._release(buffer)

    @abstractmethod
    def _allocate(self, nbytes: int, device: torch.device) -> StagingBuffer: ...

    @abstractmethod
    def _release(self, buffer: StagingBuffer) -> None: ...

    @abstractmethod
    def map(self, handle: pb.BufferHandle) -> torch.Tensor:
        """Map a buffer announced by ``handle`` as a flat uint8 tensor (no copy)."""


class MappedBuffers:
    """One owner's mapped buffers by ``buffer_id``, each handle opened once; never stale (every
    allocation gets a new id), dropped with the owner (a receiver, publisher or offer)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mapped: dict[str, torch.Tensor] = {}

    def get(self, handle: pb.BufferHandle) -> torch.Tensor:
        with self._lock:
            tensor = self._mapped.get(handle.buffer_id, _OWN.get(handle.buffer_id))
            if tensor is None:
                tensor = transport_for_handle(handle).map(handle)
                self._mapped[handle.buffer_id] = tensor
            return tensor


def transport_for_handle(handle: pb.BufferHandle) -> Transport:
    from weightsync.transports import get_transport

    return get_transport(handle.WhichOneof("kind"))
