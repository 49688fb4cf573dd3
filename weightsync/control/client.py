"""Client plumbing: channels that fail fast and clearly when the sender is not there."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from weightsync.addresses import parse_address
from weightsync.control.server import CHANNEL_OPTIONS, SERVICE_NAME
from weightsync.errors import TransportError
from weightsync.v1 import weightsync_pb2_grpc as pb_grpc


def connect(address: str, timeout_s: float = 10.0) -> tuple[grpc.Channel, pb_grpc.WeightSyncStub]:
    """Open a channel to a sender and wait until its health check says SERVING.

    Raises:
        ConfigError: a malformed address.
        TransportError: nothing answers there within ``timeout_s``.
    """
    target = parse_address(address).grpc_target
    channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s
        )
    except (grpc.FutureTimeoutError, grpc.RpcError) as e:
        channel.close()
        raise TransportError(
            f"no weightsync sender answers at {address} within {timeout_s:g} s; start one with "
            f"`weightsync-sender --listen {address}` or fix the address"
        ) from e
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        channel.close()
        raise TransportError(f"the sender at {address} is not serving (health: {reply.status})")
    return channel, pb_grpc.WeightSyncStub(channel)
