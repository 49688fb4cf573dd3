"""A broadcast group: the sender is rank 0 of a private group with its remote receivers.

The group is a torch ``ProcessGroupNCCL`` (CUDA staging) or ``ProcessGroupGloo`` (CPU staging,
so CI runs the same code) built directly on its own ``TCPStore``: it never touches
``torch.distributed``'s default group, so it cannot collide with a trainer's collectives.
"""

from __future__ import annotations

import datetime
import os
import socket
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weightsync import trace
from weightsync.errors import TransportError
from weightsync.v1 import weightsync_pb2 as pb


def host_id() -> str:
    """Identifies this host: receivers elsewhere cannot map our shm or CUDA IPC buffers.

    ``WEIGHTSYNC_HOST_ID`` overrides it, for containers that share a kernel but not /dev/shm.
    """
    if os.environ.get("WEIGHTSYNC_HOST_ID"):
        return os.environ["WEIGHTSYNC_HOST_ID"]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def local_ip_towards(host: str) -> str:
    """The address of this host's interface that routes to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


@dataclass(frozen=True)
class GroupSpec:
    group_id: str
    store_host: str
    store_port: int
    world_size: int
    backend: str
    timeout_s: float

    def join_message(self, rank: int) -> pb.GroupJoin:
        return pb.GroupJoin(
            group_id=self.group_id,
            store_host=self.store_host,
            store_port=self.store_port,
            rank=rank,
            world_size=self.world_size,
            backend=self.backend,
            timeout_s=self.timeout_s,
        )


class BroadcastGroup:
    """One member's handle on a private broadcast group (rank 0 is the sender)."""

    def __init__(self, spec: GroupSpec, rank: int, device: torch.device, store=None) -> None:
        self.spec, self.rank, self.device = spec, rank, device
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        try:
            if store is None:
                store = dist.TCPStore(
                    spec.store_host, spec.store_port, is_master=False, timeout=timeout
                )
            prefixed = dist.PrefixStore(spec.group_id, store)
            if spec.backend == "nccl":
                torch.cuda.set_device(device)
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self._pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
            else:
                # Gloo's default device follows the hostname, which another host (or network
                # namespace) may not reach: bind to the interface that routes to the store.
                options = dist.ProcessGroupGloo._Options()
                options._timeout = timeout
                options._devices = [
                    dist.ProcessGroupGloo.create_device(hostname=local_ip_towards(spec.store_host))
                ]
                self._pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, options)
        except (RuntimeError, OSError) as e:
            raise TransportError(
                f"joining broadcast group {spec.group_id} at {spec.store_host}:{spec.store_port} "
                f"as rank {rank}/{spec.world_size} failed: {e}"
            ) from e
        self._store = store

    @classmethod
    def host(
        cls, world_size: int, device: torch.device, store_host: str, timeout_s: float
    ) -> tuple[GroupSpec, dist.TCPStore]:
        """Start the rendezvous store for a new group; members join with ``GroupJoin``."""
        try:
            store = dist.TCPStore(
                store_host,
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except (RuntimeError, OSError) as e:
            raise TransportError(
                f"cannot host the broadcast rendezvous at {store_host}: {e}; set "
                "--broadcast-host (WEIGHTSYNC_BROADCAST_HOST) to an address of this machine"
            ) from e
        backend = "nccl" if device.type == "cuda" else "gloo"
        spec = GroupSpec(
            f"ws-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            store_host,
            store.port,
            world_size,
            backend,
            timeout_s,
        )
        return spec, store

    def broadcast(self, tensor: torch.Tensor) -> PendingBroadcast:
        """Rank 0 sends ``tensor``; the others receive into theirs.

        Returns at once: ``wait()`` on the result orders the current stream after the transfer
        (NCCL) or blocks until it is done (gloo).
        """
        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            work = self._pg.broadcast([tensor], options)
            trace.gpu_mark(
                "broadcast.gpu_done",
                tensor.device,
                work.wait,
                rank=self.rank,
                nbytes=tensor.numel(),
            )
            return PendingBroadcast(self, work)
        except RuntimeError as e:
            raise self._failed(e) from e

    def _failed(self, e: RuntimeError) -> TransportError:
        return TransportError(
            f"broadcast in group {self.spec.group_id} (rank {self.rank}) failed: {e}"
        )

    def close(self) -> None:
        # abort, not shutdown: NCCL's shutdown can wait for the peers, which may be closing
        # only after us (a sender and its receivers close in any order).
        shutdown = getattr(self._pg, "abort", None) or getattr(self._pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:
                pass


class PendingBroadcast:
    """A queued broadcast: ``wait()`` before touching its tensor (NCCL: a stream wait only)."""

    def __init__(self, group: BroadcastGroup, work) -> None:
        self.group, self._work = group, work

    def wait(self) -> None:
        """Raises TransportError when the broadcast failed."""
        try:
            self._work.wait()
        except RuntimeError as e:
            raise self.group._failed(e) from e
