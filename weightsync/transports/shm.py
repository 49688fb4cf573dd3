"""POSIX shared memory (``/dev/shm``) buffers, created owner-only, for CPU tensors; and the
sender's mappings of the memory publishers offer, by the descriptors they pass (never by a path
a client names: :func:`map_descriptor`).

Segments are named ``weightsync-<owner key>-<pid>-<hex>``. The owner key is a hash of the
sender's listen address (:func:`claim_staging`), so a sender restarted on the same address finds
the segments a killed predecessor left behind (2 x bucket each) and removes those whose pid is
gone; a live process's segments are never touched.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import re
import stat
import uuid
import warnings
import weakref

import torch

from weightsync.errors import TransportError
from weightsync.transports.base import StagingBuffer, Transport
from weightsync.v1 import weightsync_pb2 as pb

SHM_DIR = "/dev/shm"
"""Where segments are created; a module setting so tests can point it elsewhere."""

_PREFIX = "weightsync-"
_ANONYMOUS = "anon"  # segments of a process that claimed no listen address: never reclaimed
_owner_key = _ANONYMOUS
_SEGMENT = re.compile(r"weightsync-(?P<key>[0-9a-f]{16})-(?P<pid>\d+)-[0-9a-f]{12}")


def owner_key(listen: str) -> str:
    """The key segments of a sender listening on ``listen`` carry in their names."""
    return hashlib.sha256(listen.encode()).hexdigest()[:16]


def claim_staging(listen: str) -> list[str]:
    """Name this process's segments after ``listen`` and remove a dead predecessor's.

    Returns the paths removed. One key per process: a second sender in the same process
    renames the segments allocated after it (both live, so nothing of theirs is reclaimed).
    """
    global _owner_key
    _owner_key = owner_key(listen)
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed = []
    for entry in entries:
        m = _SEGMENT.fullmatch(entry)
        if m is None or m["key"] != _owner_key or _alive(int(m["pid"])):
            continue
        path = os.path.join(SHM_DIR, entry)
        try:
            os.unlink(path)  # receivers still mapping it keep their pages until they unmap
        except OSError:
            continue  # another user's (sticky /dev/shm) or already gone
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    # A zombie (killed, not yet reaped) maps nothing any more: its segments are orphans.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _reserve(fd: int, path: str, nbytes: int) -> None:
    # ftruncate alone makes a sparse file: a too-small /dev/shm (Docker's 64 MiB) then shows up
    # as SIGBUS in the middle of packing. fallocate takes the pages now, or fails here.
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EFBIG):
            raise TransportError(f"shared memory {path}: cannot allocate ({e.strerror})") from e
        st = os.statvfs(os.path.dirname(path))
        raise TransportError(
            f"shared memory {path}: cannot allocate {nbytes} bytes, "
            f"{os.path.dirname(path)} has {st.f_bavail * st.f_frsize} bytes free; enlarge it "
            "(docker run --shm-size=...) or stage in smaller buckets (--bucket-size-mb)"
        ) from e


def _map_file(path: str, nbytes: int, create: bool) -> torch.Tensor:
    if not create:
        _check_segment_path(path)
    # O_NOFOLLOW: a planted symlink would point the mapping at a file of the client's choice.
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise TransportError(f"shared memory {path}: refused, it is a symbolic link") from e
        raise TransportError(f"shared memory {path}: cannot open ({e.strerror})") from e
    try:
        if not create:
            _check_segment_file(fd, path)
        if create:
            try:
                if nbytes:
                    _reserve(fd, path, nbytes)
            except BaseException:
                os.unlink(path)  # a half-made segment would only leak
                raise
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


def _check_segment_path(path: str) -> None:
    """A handle names a path that a peer chose: only a file directly in :data:`SHM_DIR`."""
    parent, name = os.path.split(path)
    if parent != os.path.normpath(SHM_DIR) or name in ("", ".", ".."):
        raise TransportError(
            f"shared memory {path}: refused, not a segment directly in {SHM_DIR} (a peer may "
            "name only segments it created there)"
        )


def _check_segment_file(fd: int, path: str) -> None:
    """Only a regular file of this user (a root sender could otherwise be made to read any
    user's segment, a device or a FIFO)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise TransportError(f"shared memory {path}: refused, not a regular file")
    if st.st_uid != os.geteuid():
        raise TransportError(
            f"shared memory {path}: refused, owned by uid {st.st_uid}, not by this process's "
            f"uid {os.geteuid()} (publisher, sender and receivers must run as one user)"
        )


_RECEIVED = "fd:"
_NO_DESCRIPTOR = "no-fd:"
_received: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
"""Offered files mapped from their descriptors, by :func:`map_descriptor`'s name; an entry
lives while something holds its mapping (the stream that offered it, a cached offer)."""


def map_descriptor(fd: int, path: str, nbytes: int) -> tuple[str, torch.Tensor]:
    """Map the file open at ``fd``, which a publisher passed for its offered source ``path``
    (it could open it: the descriptor proves it), read-only; returns the name that stands for
    it from now on (its identity, st_dev and st_ino: :func:`map_offered` knows it) and the
    mapping, which keeps the file mapped while held. The caller closes ``fd``.

    Raises:
        TransportError: not a regular file, smaller than ``nbytes``, or it does not map.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise TransportError(f"shared memory {path}: refused, its descriptor is not a regular file")
    if st.st_size < nbytes:
        raise TransportError(
            f"shared memory {path}: refused, its descriptor's file holds {st.st_size} bytes, "
            f"offered {nbytes}"
        )
    try:
        # Read-only: the sender only reads offered memory, and a descriptor open for reading
        # is all a publisher needs to send.
        mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ) if st.st_size else None
    except OSError as e:
        raise TransportError(f"shared memory {path}: cannot map its descriptor ({e})") from e
    if mm is None:
        tensor = torch.empty(0, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch: "not writable"; it is read
            tensor = torch.frombuffer(mm, dtype=torch.uint8)
    name = f"{_RECEIVED}{st.st_dev}:{st.st_ino}"
    _received[name] = tensor
    return name, tensor


def without_descriptor(path: str) -> str:
    """The name of an offered source that came without its descriptor: never mapped (a
    client's own ``fd:`` path must not name another's mapping)."""
    return f"{_NO_DESCRIPTOR}{path}"


def map_offered(handle: pb.BufferHandle) -> torch.Tensor:
    """The mapping of an offered source that :func:`map_descriptor` renamed.

    Raises:
        TransportError: it came without its descriptor (names the path the client gave).
    """
    name = handle.shm.path
    tensor = _received.get(name) if name.startswith(_RECEIVED) else None
    if tensor is None or tensor.numel() < handle.nbytes:
        raise TransportError(
            f"shared memory {name.removeprefix(_NO_DESCRIPTOR)}: not mapped, its open "
            "descriptor did not come with the begin (the sender maps offered memory only from "
            "the descriptors a publisher passes on its lane, protocol §6.1)"
        )
    return tensor[: handle.nbytes]


class ShmTransport(Transport):
    name = "shm"

    def _allocate(self, nbytes: int, device: torch.device) -> StagingBuffer:
        if device.type != "cpu":
            raise TransportError(f"the shm transport stages on the CPU, not on {device}")
        buffer_id = f"{_PREFIX}{_owner_key}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
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
