"""gRPC server plumbing: bind an address, serve health checking and reflection."""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from weightsync.addresses import Address, claim_unix_socket, parse_address
from weightsync.errors import ConfigError
from weightsync.v1 import weightsync_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WeightSync"].full_name
# Streams stay open for a whole training run; keepalives make a dead peer visible.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
]
SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


# Every open stream (a receiver, a publisher rank) holds a worker thread for its whole life;
# threads start only when used, so the cap is about how many peers one sender may have.
MAX_STREAMS = 1024


def create_server(
    listen: str, add_servicers, max_workers: int = MAX_STREAMS
) -> tuple[grpc.Server, Address, health.HealthServicer]:
    """Create (not start) a server on ``listen``; returns it with the address actually bound.

    ``host:0`` binds a free port, which the returned address carries.

    Raises:
        ConfigError: a malformed address, or one another process already listens on.
    """
    address = parse_address(listen)
    claim_unix_socket(address)
    # Past the cap a call is refused (RESOURCE_EXHAUSTED) rather than queued forever.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=SERVER_OPTIONS,
        maximum_concurrent_rpcs=max_workers,
    )
    add_servicers(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        port = server.add_insecure_port(address.grpc_target)
    except RuntimeError as e:
        raise ConfigError(
            f"cannot listen on {listen}: {e} (is another sender running there?)"
        ) from e
    if address.unix_path is None:
        if port == 0:
            raise ConfigError(f"cannot listen on {listen}: address in use or not local")
        address = address.with_port(port)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, address, health_servicer
