"""CUDA IPC buffers: one handle per staging buffer, mapped once per process and cached.

Receivers on another GPU of the same host map the handle too: the owner's device is named
by UUID (indices differ between processes with different ``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Iterable

import torch

from weightsync.errors import SyncTimeoutError, TransportError
from weightsync.transports.base import StagingBuffer, Transport
from weightsync.v1 import weightsync_pb2 as pb


def device_uuid(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    return _uuid_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _uuid_of(index: int) -> str:
    # Asked every version (a publisher's hello, the sender's staging GPU): once per GPU.
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index_of(uuid_str: str, fallback: int) -> int:
    """This process's index of the GPU with ``uuid_str``."""
    for i in range(torch.cuda.device_count()):
        if _uuid_of(i) == uuid_str:
            return i
    if uuid_str:
        raise TransportError(
            f"GPU {uuid_str} that holds the buffer is not visible here; make it visible "
            "(CUDA_VISIBLE_DEVICES) or use the nccl transport"
        )
    return fallback


class CudaIpcTransport(Transport):
    name = "cuda_ipc"

    def _allocate(self, nbytes: int, device: torch.device) -> StagingBuffer:
        if device.type != "cuda":
            raise TransportError(f"cuda_ipc stages on a CUDA device, not on {device}")
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        handle = export_handle(tensor)
        return StagingBuffer(handle.buffer_id, tensor, handle)

    def _release(self, buffer: StagingBuffer) -> None:
        buffer.tensor = torch.empty(0, dtype=torch.uint8)

    def map(self, handle: pb.BufferHandle) -> torch.Tensor:
        h = handle.cuda_ipc
        index = local_index_of(h.device_uuid, h.device_index)
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                index,
                h.memory_handle,
                h.storage_size_bytes,
                h.storage_offset_bytes,
                h.ref_counter_handle,
                h.ref_counter_offset,
                h.event_handle,
                h.event_sync_required,
            )
        except RuntimeError as e:
            raise TransportError(f"cannot map CUDA IPC buffer {handle.buffer_id}: {e}") from e
        out = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
        out.set_(storage, 0, (handle.nbytes,), (1,))
        return out


def export_handle(tensor: torch.Tensor, buffer_id: str | None = None) -> pb.BufferHandle:
    """A CUDA IPC handle for ``tensor`` (which must start at its storage's first byte)."""
    if tensor.storage_offset() != 0 or not tensor.is_contiguous():
        raise TransportError("cuda_ipc exports whole contiguous storages only")
    (
        device_index,
        memory_handle,
        size_bytes,
        offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = tensor.untyped_storage()._share_cuda_()
    return pb.BufferHandle(
        buffer_id=buffer_id or f"cuda-{uuid.uuid4().hex[:12]}",
        nbytes=tensor.numel() * tensor.element_size(),
        cuda_ipc=pb.CudaIpcHandle(
            device_uuid=device_uuid(tensor.device),
            device_index=device_index,
            memory_handle=memory_handle,
            storage_size_bytes=size_bytes,
            storage_offset_bytes=offset_bytes,
            ref_counter_handle=ref_counter_handle,
            ref_counter_offset=ref_counter_offset,
            event_handle=event_handle or b"",
            event_sync_required=event_sync_required,
        ),
    )


Waited = tuple[str, torch.cuda.Event]
"""An event recorded on a stream, and that stream for an error message."""


def named_events(pairs: Iterable[tuple[str, torch.cuda.Event | None]]) -> tuple[Waited, ...]:
    """Each event of ``(tensor name, ready event)`` pairs once, named by its first tensor
    (None: written already)."""
    found: dict[int, Waited] = {}
    for name, event in pairs:
        if event is not None:
            found.setdefault(id(event), (f"the stream of the ready event of {name!r}", event))
    return tuple(found.values())


def wait_for_streams(
    devices: Iterable[torch.device],
    timeout_s: float | None = None,
    what: str = "wait",
    events: Iterable[Waited] = (),
) -> None:
    """Wait for what the current streams of CUDA ``devices`` queued, and for ``events``:
    another process that reads the memory they write is reached by no stream order
    (:meth:`QueuedWork.wait`)."""
    if timeout_s is None:
        for device in devices:
            torch.cuda.current_stream(device).synchronize()
        for _, event in events:
            event.synchronize()
        return
    QueuedWork(devices, events).wait(timeout_s, what)


class QueuedWork:
    """What the current streams of CUDA ``devices`` have queued now, and ``events`` (recorded
    on any stream), to wait for later: the caller may queue more work first."""

    def __init__(self, devices: Iterable[torch.device], events: Iterable[Waited] = ()) -> None:
        self._events: list[Waited] = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events.append((f"{device}'s current stream", event))
        self._events += events

    def done(self) -> bool:
        return all(event.query() for _, event in self._events)

    def wait(self, timeout_s: float | None = None, what: str = "wait") -> None:
        """Wait for that work (at most ``timeout_s``).

        Raises:
            SyncTimeoutError: with ``timeout_s``, a device's queued work not done by then (a
                synchronize cannot be interrupted, so the wait polls the event instead),
                naming ``what`` and the device.
        """
        if timeout_s is None:
            for _, event in self._events:
                event.synchronize()
            return
        start = time.monotonic()
        deadline, spin_until = start + timeout_s, start + _SPIN_S
        for where, event in self._events:
            while not event.query():
                now = time.monotonic()
                if now >= deadline:
                    raise SyncTimeoutError(
                        f"{what}: the work queued on {where} was not done "
                        f"within {timeout_s:g} s (a kernel or collective that never ends?)"
                    )
                # sleep(0) lets other threads of this process run without the ~0.1 ms a timed
                # sleep costs (the event just recorded is often done a few microseconds later).
                time.sleep(0 if now < spin_until else _POLL_S)


_SPIN_S = 1e-3
"""How long a bounded wait looks at the GPU without sleeping: an idle GPU reaches the event
just recorded a few microseconds later, where a timed sleep cost about 0.18 ms of every
``publish`` (H200, traced: the first look came too soon, the second after the sleep)."""
_POLL_S = 50e-6
"""After :data:`_SPIN_S`, how often a bounded wait looks at the GPU: about a tenth of a
millisecond late at most (a 50 us sleep took about 110 us on the CI box)."""


# Interprocess events order the GPU work of sender and receivers on one host without a CPU
# wait per bucket: a receiver's stream waits for the "packed" event of a staging buffer, the
# sender's for the receivers' "read" events before it packs into that buffer again.
# Held strongly (a weak reference to a torch.cuda.Event crashed the interpreter on H200 /
# torch 2.11); owners drop theirs with release_event.
_OWN_EVENTS: dict[bytes, torch.cuda.Event] = {}


def new_event(device: torch.device) -> tuple[torch.cuda.Event, bytes]:
    """An interprocess CUDA event on ``device`` and its handle for other processes."""
    with torch.cuda.device(device):
        event = torch.cuda.Event(interprocess=True)
        event.record()  # creates it on this device; a handle needs a created event
        handle = bytes(event.ipc_handle())
    _OWN_EVENTS[handle] = event
    return event, handle


def event_handle(event: torch.cuda.Event) -> bytes:
    """The handle of ``event``, an interprocess event of this process (another process opens
    it by the handle; one in this process gets ``event`` back), kept until
    :func:`release_event`.

    Raises:
        TransportError: ``event`` was not made with ``interprocess=True``.
    """
    try:
        handle = bytes(event.ipc_handle())
    except RuntimeError as e:
        raise TransportError(
            "an event other processes wait for must be made with "
            f"torch.cuda.Event(interprocess=True): {e}"
        ) from None
    _OWN_EVENTS[handle] = event
    return handle


def release_event(handle: bytes) -> None:
    """Forget an event made by :func:`new_event` or handed out by :func:`event_handle` (its
    owner no longer uses it)."""
    _OWN_EVENTS.pop(handle, None)


class EventCache:
    """Events of other processes opened once by handle (this process's own used as they are);
    never stale (a handle names one event), dropped with the owner."""

    def __init__(self) -> None:
        self._opened: dict[bytes, torch.cuda.Event] = {}

    def get(self, handle: bytes, device: torch.device) -> torch.cuda.Event:
        event = self._opened.get(handle) or _OWN_EVENTS.get(handle)
        if event is None:
            try:
                event = torch.cuda.Event.from_ipc_handle(device, handle)
            except RuntimeError as e:
                raise TransportError(f"cannot open a CUDA IPC event on {device}: {e}") from e
            self._opened[handle] = event
        return event
