"""One ``weightsync-sender`` per node of a Ray placement group, and each worker's address.

verl, NeMo-RL and slime place their trainer and rollout workers in Ray placement groups, one
actor per bundle. :meth:`SenderActors.start` puts one more actor on every node the group
spans, pinned to the first bundle on that node (``PlacementGroupSchedulingStrategy``, no CPU
taken from the bundle by default), running the sender daemon
(:class:`~weightsync.sender.Sender`) in its own process; workers then find their node's
sender::

    senders = SenderActors.start(pg)               # after pg.ready(); senders is picklable
    # in a trainer or engine worker placed in pg:
    publisher = Publisher(senders.local_address())  # or senders.address_for(node_id)
    addresses = senders.addresses()                 # node id -> address, in bundle order

The listen address is a template formatted on each node: ``{node_id}`` (Ray's hex node id)
and ``{node_ip}``; the default, a unix socket named after the node, reaches only workers
on that node; ``"{node_ip}:0"`` listens on TCP (a free port; the address says which), which
needs the token, and puts the broadcast rendezvous (``broadcast_host``) on the node's IP for
receivers on other hosts. The token is ``WEIGHTSYNC_TOKEN`` of the process that calls
:meth:`~SenderActors.start` (or ``token=``), handed to each actor as a ``SecretStr``, so
Ray's task and error logs show only ``**********``; workers send it from their own
``WEIGHTSYNC_TOKEN``.

:meth:`SenderActors.shutdown` stops every sender (its socket file and staging shm removed)
and kills the actors; an actor that exits gracefully without it closes its sender too. A
sender that cannot start raises one error naming each such node (id, IP, bundle) and why,
after stopping the senders that did start.

Tested (CPU, ``tests/integration/test_ray.py``) on a local two-node ``ray.cluster_utils``
cluster with Ray 2.60, including a version split over both nodes' senders; not on separate
hosts or GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from pydantic import SecretStr
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from weightsync.addresses import parse_address
from weightsync.errors import ConfigError, SyncTimeoutError, TransportError, WeightSyncError
from weightsync.sender import Sender

DEFAULT_LISTEN = "unix:/tmp/weightsync-{node_id}.sock"
TOKEN_ENV = "WEIGHTSYNC_TOKEN"
BROADCAST_HOST_ENV = "WEIGHTSYNC_BROADCAST_HOST"
_REASON_CHARS = 1024
"""A failed actor's reason is cut here: Ray's texts carry whole remote tracebacks."""


@dataclass(frozen=True)
class SenderInfo:
    """Where one sender runs, as its actor saw it."""

    node_id: str
    node_ip: str
    bundle_index: int
    address: str
    broadcast_host: str
    """Where receivers on other hosts join its broadcast group: a TCP sender's node IP."""
    pid: int


class SenderActor:
    """The actor's class: one :class:`~weightsync.sender.Sender` in the actor's process."""

    def __init__(self) -> None:
        self._sender: Sender | None = None

    def start(
        self, listen: str, bundle_index: int, token: SecretStr | None, settings: dict[str, Any]
    ) -> SenderInfo:
        node_id = ray.get_runtime_context().get_node_id()
        node_ip = ray.util.get_node_ip_address()
        listen = listen.format(node_id=node_id, node_ip=node_ip)
        given = dict(settings)
        if token is not None:
            given["token"] = token
        if parse_address(listen).unix_path is None and BROADCAST_HOST_ENV not in os.environ:
            # Reachable from other nodes: so must its broadcast rendezvous be (not 127.0.0.1).
            given.setdefault("broadcast_host", node_ip)
        self._sender = Sender(listen, **given)
        return SenderInfo(
            node_id,
            node_ip,
            bundle_index,
            self._sender.address,
            self._sender.settings.broadcast_host,
            os.getpid(),
        )

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()

    def __ray_shutdown__(self) -> None:
        """Ray calls this when the actor exits gracefully (handles gone, ``__ray_terminate__``)."""
        self.close()


class SenderActors:
    """The senders of one placement group, one per node; see the module's text.

    Picklable (actor handles and addresses), so it can be handed to workers.
    """

    def __init__(self, senders: Mapping[str, tuple[ActorHandle, SenderInfo]]) -> None:
        self._senders = dict(senders)

    @classmethod
    def start(
        cls,
        pg: PlacementGroup,
        *,
        listen: str = DEFAULT_LISTEN,
        token: str | SecretStr | None = None,
        timeout_s: float = 120.0,
        actor_options: Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> SenderActors:
        """Start a sender on every node ``pg`` spans; returns once all listen.

        Args:
            pg: the placement group whose nodes get a sender each.
            listen: address template; ``{node_id}`` and ``{node_ip}`` are filled in per node.
            token: the token the senders require (default: this process's
                ``WEIGHTSYNC_TOKEN``; else each node's own ``WEIGHTSYNC_*`` settings apply).
            timeout_s: how long the group may take to be ready and each sender to start.
            actor_options: Ray options for the actors (default ``num_cpus=0``); the
                scheduling strategy is always the bundle's.
            **settings: :class:`~weightsync.config.SenderSettings` fields for every sender.

        Raises:
            ConfigError: ``listen`` is no address template (before anything starts),
                ``actor_options`` do not fit a bundle, or a sender failed to start (the
                sender's own error type where it raised one; SyncTimeoutError where it did not
                start in time): the message names each such node, its IP and bundle, and why.
            SyncTimeoutError: the placement group was not ready within ``timeout_s``.
        """
        check_listen(listen)
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except GetTimeoutError:
            raise SyncTimeoutError(
                f"placement group {pg.id.hex()} was not ready within {timeout_s:.0f} s (bundles "
                f"{pg.bundle_specs}); the cluster lacks room for it"
            ) from None
        if token is None and os.environ.get(TOKEN_ENV):
            token = os.environ[TOKEN_ENV]
        secret = SecretStr(token) if isinstance(token, str) else token
        remote = ray.remote(SenderActor)
        options = {"num_cpus": 0, **(actor_options or {})}
        handles, calls = {}, {}
        for node_id, index in first_bundle_per_node(pg).items():
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
            try:
                handles[node_id] = remote.options(**options, scheduling_strategy=strategy).remote()
            except ValueError as e:  # Ray refuses options the bundle cannot hold, at once
                for handle in handles.values():
                    ray.kill(handle)
                raise ConfigError(
                    f"weightsync sender for node {node_id} (placement group bundle {index}): "
                    f"actor_options={options!r}: {e}"
                ) from None
            calls[node_id] = (index, handles[node_id].start.remote(listen, index, secret, settings))
        ray.wait([ref for _, ref in calls.values()], num_returns=len(calls), timeout=timeout_s)
        started: dict[str, tuple[ActorHandle, SenderInfo]] = {}
        failed: list[tuple[str, int, BaseException | str]] = []
        for node_id, (index, ref) in calls.items():
            try:
                started[node_id] = handles[node_id], ray.get(ref, timeout=0)
            except GetTimeoutError:
                failed.append((node_id, index, f"did not start within {timeout_s:.0f} s"))
            except RayError as e:
                failed.append((node_id, index, e))
        if failed:
            _stop(started, timeout_s)  # what it cannot stop, the next sender there reclaims
            for node_id in calls.keys() - started.keys():
                ray.kill(handles[node_id])
            raise _start_error(failed)
        return cls(started)

    @property
    def senders(self) -> list[SenderInfo]:
        """Every sender, in bundle order."""
        return [info for _, info in self._senders.values()]

    def addresses(self) -> dict[str, str]:
        """Node id -> that node's sender address, in bundle order (an engine receiving a
        version split over several senders registers with each)."""
        return {node_id: info.address for node_id, (_, info) in self._senders.items()}

    def address_for(self, node_id: str) -> str:
        """The sender address on node ``node_id`` (Ray's hex node id)."""
        try:
            return self._senders[node_id][1].address
        except KeyError:
            raise ConfigError(
                f"no weightsync sender on node {node_id}; the senders run on nodes "
                f"{sorted(self._senders)}: place this worker in their placement group"
            ) from None

    def local_address(self) -> str:
        """The sender address on the node this (worker) process runs on."""
        return self.address_for(ray.get_runtime_context().get_node_id())

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop every sender (sockets and staging removed) and kill the actors; idempotent.

        Raises:
            TransportError: naming each node whose sender did not stop within ``timeout_s``
                or could not (its actor had died); the actors are killed all the same, and the
                next sender on that address reclaims the socket and shm left behind.
        """
        senders, self._senders = self._senders, {}
        failed = _stop(senders, timeout_s)
        if failed:
            raise TransportError(f"weightsync senders not stopped cleanly: {'; '.join(failed)}")

    def __enter__(self) -> SenderActors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def check_listen(listen: str) -> None:
    """Refuse a template that no node could fill in, before any actor starts.

    Raises:
        ConfigError: an unknown placeholder, or not an address once filled in.
    """
    try:
        filled = listen.format(node_id="0" * 56, node_ip="192.0.2.1")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(
            f"listen={listen!r}: a template may name only {{node_id}} and {{node_ip}} ({e!r})"
        ) from None
    try:
        parse_address(filled)
    except ConfigError as e:
        raise ConfigError(f"listen={listen!r}, filled in on a node: {e}") from None


def first_bundle_per_node(pg: PlacementGroup) -> dict[str, int]:
    """Node id -> the lowest bundle index of ``pg`` on that node, in bundle order."""
    bundle_nodes: dict[int, str] = placement_group_table(pg)["bundles_to_node_id"]
    first: dict[str, int] = {}
    for index in sorted(bundle_nodes):
        first.setdefault(bundle_nodes[index], index)
    return first


def _stop(senders: Mapping[str, tuple[ActorHandle, SenderInfo]], timeout_s: float) -> list[str]:
    """Close every sender, then kill its actor; returns a line for each that did not close."""
    closing = {node_id: handle.close.remote() for node_id, (handle, _) in senders.items()}
    ray.wait(list(closing.values()), num_returns=len(closing), timeout=timeout_s)
    failed = []
    for node_id, ref in closing.items():
        try:
            ray.get(ref, timeout=0)
        except GetTimeoutError:
            failed.append(f"node {node_id}: did not stop within {timeout_s:.0f} s")
        except RayError as e:
            failed.append(f"node {node_id}: {_reason(e)}")
    for handle, _ in senders.values():
        ray.kill(handle)
    return failed


def _reason(error: BaseException | str) -> str:
    if isinstance(error, RayTaskError) and error.cause is not None:
        error = error.cause
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return text.strip()[:_REASON_CHARS]


def _kind(error: BaseException | str) -> type[WeightSyncError]:
    """The error type a failed start is reported as: the sender's own, a timeout's, else a
    deployment problem (the actor died: weightsync missing on the node, no room)."""
    if isinstance(error, str):
        return SyncTimeoutError
    if isinstance(error, RayTaskError) and isinstance(error.cause, WeightSyncError):
        return type(error.cause)
    return ConfigError


def _start_error(failed: list[tuple[str, int, BaseException | str]]) -> WeightSyncError:
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    lines = [
        f"node {node_id} ({ips.get(node_id, 'IP unknown')}, placement group bundle {index}): "
        f"{_reason(error)}"
        for node_id, index, error in failed
    ]
    kinds = {_kind(error) for _, _, error in failed}
    kind = kinds.pop() if len(kinds) == 1 else ConfigError
    return kind(f"weightsync sender failed to start on {len(failed)} node(s): " + "; ".join(lines))
