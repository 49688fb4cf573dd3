"""POSIX shared memory (``/dev/shm``) buffers, created owner-only, for CPU tensors."""

from __future__ import annotations

import mmap
import os
import uuid

import torch

from weightsync.errors import TransportError
from weightsync.transports.base import StagingBuffer, Transport
from weightsync.v1 import weightsync_pb2 as pb

SHM_DIR = "/dev/shm"


def _map_file(path: str, nbytes: int, create: bool) -> torch.Tensor:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        raise TransportError(f"shared memory {path}: cannot open ({e.strerror})") from e
    try:
        if create:
            os.ftruncate(fd, nbytes)
        elif os.fstat(fd).st_size < nbytes:
            raise TransportError(
                f"shared memory {path} holds {os.fstat(fd).st_size} bytes, announced {nbytes}"
            )
        # mmap keeps its own reference to the file; the fd can go.
        mm = mmap.mmap(fd, max(nbytes, 1))
    finally:
        os.close(fd)
    return (
        torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
        if nbytes
        else torch.empty(0, dtype=torch.uint8)
    )


class ShmTransport(Transport):
    name = "shm"

    def _allocate(self, nbytes: int, device: torch.device) -> StagingBuffer:
        if device.type != "cpu":
            raise TransportError(f"the shm transport stages on the CPU, not on {device}")
        buffer_id = f"weightsync-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        path = os.path.join(SHM_DIR, buffer_id)
        tensor = _map_file(path, nbytes, create=True)
        handle = pb.BufferHandle(buffer_id=buffer_id, nbytes=nbytes, shm=pb.ShmHandle(path=path))
        return StagingBuffer(buffer_id, tensor, handle)

    def _release(self, buffer: StagingBuffer) -> None:
        # Unlinking frees the memory once every process has dropped its mapping.
        try:
            os.unlink(buffer.handle.shm.path)
        except FileNotFoundError:
            pass

    def map(self, handle: pb.BufferHandle) -> torch.Tensor:
        return _map_file(handle.shm.path, handle.nbytes, create=False)
