"""Client plumbing: channels that fail fast and clearly when the sender is not there."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from weightsync.addresses import parse_address
from weightsync.config import ClientSettings
from weightsync.control.auth import BearerToken, client_credentials, read_token
from weightsync.control.server import CHANNEL_OPTIONS, SERVICE_NAME
from weightsync.errors import TransportError
from weightsync.v1 import weightsync_pb2_grpc as pb_grpc


def connect(address: str, timeout_s: float = 10.0) -> tuple[grpc.Channel, pb_grpc.WeightSyncStub]:
    """Open a channel to a sender and wait until its health check says SERVING.

    Every call on the channel carries ``WEIGHTSYNC_TOKEN`` (or the ``WEIGHTSYNC_TOKEN_FILE``
    one) when set; TLS is used when ``WEIGHTSYNC_TLS_CA`` or ``WEIGHTSYNC_TLS_CERT`` is
    (:class:`~weightsync.config.ClientSettings`).

    Raises:
        ConfigError: a malformed address, an invalid or unreadable token or TLS setting.
        TransportError: nothing answers there within ``timeout_s``, or the sender is at its
            call limit (said so).
    """
    target = parse_address(address).grpc_target
    settings = ClientSettings()
    token = read_token(settings.token, settings.token_file)
    credentials = client_credentials(settings)
    if credentials is None:
        channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    else:
        channel = grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
    if token is not None:
        channel = grpc.intercept_channel(channel, BearerToken(token))
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s
        )
    except (grpc.FutureTimeoutError, grpc.RpcError) as e:
        channel.close()
        if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise TransportError(
                f"the sender at {address} answers but refused the call: it is at its limit of "
                f"concurrent calls ({e.details()}); close clients that are done, or start it "
                "with a higher WEIGHTSYNC_MAX_STREAMS"
            ) from e
        hint = _tls_hint(target, credentials)
        raise TransportError(
            f"no weightsync sender answers at {address} within {timeout_s:g} s; start one with "
            f"`weightsync-sender --listen {address}` or fix the address{hint}"
        ) from e
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        channel.close()
        raise TransportError(f"the sender at {address} is not serving (health: {reply.status})")
    return channel, pb_grpc.WeightSyncStub(channel)


def _tls_hint(target: str, credentials: grpc.ChannelCredentials | None) -> str:
    """A TLS sender and a plaintext client (or a refused certificate) look like no sender."""
    if target.startswith("unix:"):
        return ""
    if credentials is None:
        return (
            " (a sender with TLS needs WEIGHTSYNC_TLS_CA here, and for mutual TLS "
            "WEIGHTSYNC_TLS_CERT and WEIGHTSYNC_TLS_KEY)"
        )
    return " (or it does not accept this client's TLS certificate)"
