"""An offer: where tensors live, for a process on the same host to map and read or write (a
publisher's to its sender; a receiver's weights, for the sender to write: protocol §4.3)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from weightsync import limits
from weightsync.errors import ConfigError, TransportError
from weightsync.regions import Region
from weightsync.transports.base import own_handle, register_own
from weightsync.transports.cuda_ipc import event_handle, export_handle, release_event
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import regions_to_pb

log = logging.getLogger("weightsync.exports")


class Exports:
    """The storages of a publisher's last offer, exported, and that offer's wire form.
    ``who`` offers and ``instead`` happens where it cannot (both for the warning)."""

    def __init__(self, who: str, instead: str) -> None:
        self._who, self._instead = who, instead
        self._exported: dict[tuple[int, int, str], tuple[pb.BufferHandle, torch.Tensor]] = {}
        """IPC exports by storage (address, size, device); only the last offer's are kept."""
        self._last: tuple[Mapping, Mapping | None, pb.BeginVersion | None] | None = None
        """The last offer's wire form, by the identity of the regions and ready mappings."""
        self._handles: list[bytes] = []
        """The handles of the last offer's ready events (kept for a sender in this process)."""
        self.events: tuple[torch.cuda.Event, ...] = ()
        """The last offer's ready events, in the order of its ``ready``."""

    def offer(
        self,
        regions: Mapping[str, Sequence[Region]],
        ready: Mapping[str, torch.cuda.Event] | None = None,
    ) -> pb.BeginVersion | None:
        """A begin's ``sources`` and ``pieces`` describing ``regions``: worked out once per
        mapping (by identity, so callers pass the same one while their tensors stay put); each
        storage is exported once (Megatron keeps parameters in a few large buffers). Only
        tensors other processes can map are offered: CUDA memory, or a staging buffer this
        process allocated (shm). None, with a warning, where they lie in more storages than
        one offer may name (``limits.MAX_SOURCES``: a module with a storage per parameter,
        such as an MoE model in HF layout, has one per expert weight). ``ready``: each CUDA
        tensor's interprocess event, recorded once it is written (``BeginVersion.ready``).

        Raises:
            ConfigError: an event of ``ready`` is not an interprocess one (names its tensor).
        """
        if self._last is None or self._last[0] is not regions or self._last[1] is not ready:
            offered = regions
            regions = {
                n: rs
                for n, rs in regions.items()
                if all(r.source.is_cuda or own_handle(r.source) for r in rs)
            }
            storages = {_storage_key(r.source) for rs in regions.values() for r in rs}
            if len(storages) > limits.MAX_SOURCES:
                log.warning(
                    "%s: its tensors lie in %d storages, over the %d one offer may name; %s. "
                    "Tensors kept in a few large buffers (as Megatron's DDP keeps its "
                    "parameters) can be offered",
                    self._who,
                    len(storages),
                    limits.MAX_SOURCES,
                    self._instead,
                )
                self._exported, self._last = {}, (offered, ready, None)
                return None
            offer = pb.BeginVersion()
            index: dict[str, int] = {}
            # Only the storages of this offer stay exported (and so referenced).
            previous, self._exported = self._exported, {}

            def locate(tensor: torch.Tensor) -> tuple[int, int]:
                storage, skey = tensor.untyped_storage(), _storage_key(tensor)
                if skey not in self._exported:
                    hit = previous.get(skey)
                    if hit is None and not tensor.is_cuda:
                        hit = (own_handle(tensor), tensor)
                    if hit is None:
                        whole_storage = torch.empty(0, dtype=torch.uint8, device=tensor.device)
                        whole_storage.set_(storage, 0, (storage.nbytes(),), (1,))
                        hit = (export_handle(whole_storage), whole_storage)
                        register_own(hit[0].buffer_id, whole_storage)
                    self._exported[skey] = hit
                handle = self._exported[skey][0]
                if handle.buffer_id not in index:
                    index[handle.buffer_id] = len(offer.sources)
                    offer.sources.append(handle)
                return index[handle.buffer_id], tensor.storage_offset() * tensor.element_size()

            waits = self._ready(offer, regions, ready or {})
            offer.pieces.extend(regions_to_pb(regions, locate, waits))
            self._last = (offered, ready, offer)
        return self._last[2]

    def _ready(
        self, offer: pb.BeginVersion, regions: Mapping, ready: Mapping[str, torch.cuda.Event]
    ) -> dict[str, int]:
        """Put the events of ``ready`` the CUDA tensors of ``regions`` wait for in
        ``offer.ready``, once each; returns each such tensor's ``SourcePiece.ready``."""
        for handle in self._handles:
            release_event(handle)
        self._handles, index, waits, events = [], {}, {}, []
        for name, parts in regions.items():
            event = ready.get(name)
            if event is None or not parts or not parts[0].source.is_cuda:
                continue
            if id(event) not in index:
                try:
                    handle = event_handle(event)
                except TransportError as e:
                    raise ConfigError(f"the ready event of {name!r}: {e}") from None
                self._handles.append(handle)
                offer.ready.append(handle)
                events.append(event)
                index[id(event)] = len(offer.ready)
            waits[name] = index[id(event)]
        self.events = tuple(events)
        return waits


def _storage_key(tensor: torch.Tensor) -> tuple[int, int, str]:
    """The storage ``tensor`` lies in: (address, size, device)."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes(), str(tensor.device)
