"""gRPC server plumbing: bind an address, serve health checking and reflection."""

from __future__ import annotations

import errno
import os
import resource
import secrets
import socket
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from weightsync.addresses import Address, claim_unix_socket, parse_address
from weightsync.control.auth import ServerSecurity, TokenInterceptor
from weightsync.control.streams import SPARE_CALLS, StreamLimit
from weightsync.errors import ConfigError
from weightsync.v1 import weightsync_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WeightSync"].full_name
# Streams stay open for a whole training run; keepalives make a dead peer visible.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # gRPC 1.85 waits for a keepalive ping's ack this long (default 60 s), whatever
    # keepalive_timeout_ms says: without it a SIGSTOPped peer went unnoticed for a minute.
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
]
SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
    # A connection that has not finished its HTTP/2 (and TLS) handshake holds a descriptor
    # with no token checked yet: drop it after 5 s rather than gRPC's 120.
    ("grpc.server_handshake_timeout_ms", 5_000),
]
FD_LIMIT_CAP = 1 << 20
"""The descriptor limit the server raises itself to when the hard limit is unlimited."""


# Every open stream (a receiver, a publisher rank) holds a worker thread for its whole life;
# threads start only when used, so the cap is about how many peers one sender may have.
MAX_STREAMS = 1024


def create_server(
    listen: str,
    add_servicers,
    max_streams: int = MAX_STREAMS,
    security: ServerSecurity | None = None,
) -> tuple[grpc.Server, Address, health.HealthServicer]:
    """Create (not start) a server on ``listen``; returns it with the address actually bound.

    ``host:0`` binds a free port, which the returned address carries. ``security``: the token
    every call must carry and the TLS credentials (default: neither); a unix socket is 0600, or
    0660 with ``security.socket_group``, whatever the umask.

    Raises:
        ConfigError: a malformed address, or one another process already listens on.
    """
    security = security or ServerSecurity()
    raise_fd_limit()
    address = parse_address(listen)
    claim_unix_socket(address)
    check_bindable(address)
    # Past the cap a call is refused (RESOURCE_EXHAUSTED) rather than queued forever; streams
    # are refused first, in words, so that a full sender still answers health and Status.
    calls = max_streams + SPARE_CALLS
    interceptors = [TokenInterceptor(security.token)] if security.token else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=calls),
        options=SERVER_OPTIONS,
        maximum_concurrent_rpcs=calls,
        interceptors=[*interceptors, StreamLimit(SERVICE_NAME, max_streams)],
    )
    add_servicers(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    if address.unix_path is not None:
        _bind_unix(server, address, security)
        return server, address, _serving(health_servicer)
    port = _add_port(server, address.grpc_target, listen, security)
    if port == 0:
        raise ConfigError(f"cannot listen on {listen}: address in use or not local")
    return server, address.with_port(port), _serving(health_servicer)


def raise_fd_limit() -> int:
    """Raise this process's descriptor soft limit to its hard limit; returns the new soft limit.

    Every connection holds a descriptor before any token is checked: under the common soft
    limit of 1024, a flood of connections that never speak starved the trainer's and engines'
    calls. The hard limit (often 2^19 or more) needs no privilege to reach.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_LIMIT_CAP if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):  # a container's nr_open below the hard limit
            pass
    return soft


def _add_port(server: grpc.Server, target: str, listen: str, security: ServerSecurity) -> int:
    try:
        if security.credentials is not None:
            return server.add_secure_port(target, security.credentials)
        return server.add_insecure_port(target)
    except RuntimeError as e:  # what check_bindable could not foresee
        why = str(e).split(";")[0].strip()
        raise ConfigError(f"cannot listen on {listen}: {why}") from None


def _bind_unix(server: grpc.Server, address: Address, security: ServerSecurity) -> None:
    """Bind the socket where only we can reach it, set its mode, then move it into place.

    gRPC binds (and listens) in ``add_*_port``, with the mode the umask leaves (0777 under
    umask 000): bound at ``address`` itself, it would be open to every local user until a
    chmod. Bound inside a fresh 0700 directory beside it, nobody else can reach it before
    the rename makes it visible with its final mode.
    """
    path = address.unix_path
    assert path is not None
    private = _private_dir(os.path.dirname(path))
    staged = os.path.join(private, "s")
    try:
        _add_port(server, f"unix:{staged}", address.text, security)
        if security.socket_group is not None:
            os.chown(staged, -1, security.socket_group)
        os.chmod(staged, 0o660 if security.socket_group is not None else 0o600)
        os.rename(staged, path)  # the listening socket is the inode: it moves with the name
    finally:
        if os.path.exists(staged):
            os.unlink(staged)
        os.rmdir(private)


def _private_dir(parent: str) -> str:
    """A new 0700 directory in ``parent`` with a short name: a socket path is limited to 107
    bytes, and ``<parent>/.xxxx/s`` is no longer than the final path unless its name is 1-5
    characters long."""
    while True:
        private = os.path.join(parent, f".{secrets.token_hex(2)}")
        try:
            os.mkdir(private, 0o700)  # the umask can only narrow it
            return private
        except FileExistsError:
            continue


def _serving(health_servicer: health.HealthServicer) -> health.HealthServicer:
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return health_servicer


_HINT = "pick another address (--listen, WEIGHTSYNC_LISTEN)"


def check_bindable(address: Address) -> None:
    """Say in one line why gRPC could not bind ``address``, before it tries (and logs).

    Raises:
        ConfigError: a unix socket's directory is missing or not writable; a TCP host that is
            not an address of this machine, or a port another process listens on.
    """
    where = address.text
    if address.unix_path is not None:
        parent = os.path.dirname(address.unix_path) or "/"
        if not os.path.isdir(parent):
            raise ConfigError(
                f"cannot listen on {where}: directory {parent} does not exist; create it or "
                + _HINT
            )
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(
                f"cannot listen on {where}: directory {parent} is not writable; " + _HINT
            )
        return
    if not address.port:
        return  # port 0: any free port
    try:
        infos = socket.getaddrinfo(
            address.host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise ConfigError(
            f"cannot listen on {where}: host {address.host!r}: {e.strerror}"
        ) from None
    family, kind, proto, _, sockaddr = infos[0]
    probe = socket.socket(family, kind, proto)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
        probe.bind(sockaddr)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            why = "address already in use (is another sender running there?)"
        elif e.errno == errno.EADDRNOTAVAIL:
            why = f"{address.host} is not an address of this machine"
        else:
            why = e.strerror or str(e)
        raise ConfigError(f"cannot listen on {where}: {why}; " + _HINT) from None
    finally:
        probe.close()
