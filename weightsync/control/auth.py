"""Who may talk to a sender: a shared token (``authorization: Bearer <token>`` on every call,
compared in constant time) and/or mutual TLS, resolved from settings for both ends.

The server side is an interceptor, so no servicer needs to know; the client side is a channel
interceptor that :func:`weightsync.control.client.connect` installs, so every caller sends the
token. Health checking and reflection stay open: clients probe health to find a live sender,
and reflection describes only the public ``.proto``.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from pydantic import SecretStr

from weightsync.addresses import Address
from weightsync.config import ClientSettings, SenderSettings
from weightsync.errors import ConfigError

METADATA_KEY = "authorization"
SCHEME = "Bearer "
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Method prefixes served without a token."""


# ---- settings -> secrets ----------------------------------------------------------------------


def read_token(token: SecretStr | None, token_file: str | None) -> str | None:
    """The token from ``WEIGHTSYNC_TOKEN`` or the file ``WEIGHTSYNC_TOKEN_FILE`` names (its
    content, surrounding whitespace stripped); None when neither is set (an empty value counts
    as unset).

    Raises:
        ConfigError: both set, an unreadable or empty file, a token that cannot travel as gRPC
            metadata (non-ASCII, spaces, control characters).
    """
    value = token.get_secret_value() if token is not None else ""
    if token_file:
        if value:
            raise ConfigError(
                "WEIGHTSYNC_TOKEN and WEIGHTSYNC_TOKEN_FILE are both set; set only one"
            )
        text = _read(token_file, "WEIGHTSYNC_TOKEN_FILE").decode(errors="replace")
        value = text.strip()
        if not value:
            raise ConfigError(f"WEIGHTSYNC_TOKEN_FILE={token_file!r} is empty; put the token in it")
        where = f"the token in {token_file}"
    else:
        where = "WEIGHTSYNC_TOKEN"
    if not value:
        return None
    if not all(33 <= ord(c) <= 126 for c in value):
        # Never echo the token itself: it may be a real secret with a typo.
        raise ConfigError(
            f"{where} must be printable ASCII without spaces (e.g. `openssl rand -hex 32`)"
        )
    return value


def _read(path: str, setting: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{setting}={path!r} cannot be read ({e.strerror})") from None


@dataclass(frozen=True)
class ServerSecurity:
    token: str | None = None
    credentials: grpc.ServerCredentials | None = None
    """TLS; None: plaintext."""
    socket_group: int | None = None
    """A unix socket's group (the socket is then 0660); None: 0600."""
    mutual_tls: bool = False

    def describe(self, address: Address) -> str:
        """E.g. ``token, mutual TLS`` or ``INSECURE: no token, no TLS``."""
        parts = ["token"] if self.token else []
        if self.credentials is not None:
            parts.append("mutual TLS" if self.mutual_tls else "TLS")
        if address.unix_path is not None:
            parts.append("socket 0660" if self.socket_group is not None else "socket 0600")
        return ", ".join(parts) if parts else "INSECURE: no token, no TLS"


def server_security(settings: SenderSettings, address: Address) -> ServerSecurity:
    """What the sender at ``address`` requires of its clients.

    Raises:
        ConfigError: an unreadable token or TLS file, a TLS key without its certificate (or the
            reverse), a CA without them, an unknown socket group, or TCP with neither a token
            nor client certificates (``tls_ca``) unless ``insecure``.
    """
    token = read_token(settings.token, settings.token_file)
    credentials, root = None, None
    cert, key, ca = settings.tls_cert, settings.tls_key, settings.tls_ca
    if bool(cert) != bool(key) or (ca and not cert):
        raise ConfigError(
            "TLS needs both --tls-cert and --tls-key (WEIGHTSYNC_TLS_CERT, WEIGHTSYNC_TLS_KEY); "
            "--tls-ca (WEIGHTSYNC_TLS_CA) adds client certificates to them"
        )
    if cert and key:
        root = _read(ca, "WEIGHTSYNC_TLS_CA") if ca else None
        credentials = grpc.ssl_server_credentials(
            [(_read(key, "WEIGHTSYNC_TLS_KEY"), _read(cert, "WEIGHTSYNC_TLS_CERT"))],
            root_certificates=root,
            require_client_auth=root is not None,
        )
    # TLS without a CA proves only the sender to its clients, not the clients to it.
    guarded = token is not None or root is not None or address.unix_path is not None
    if not guarded and not settings.insecure:
        raise ConfigError(
            f"listen={address.text!r} is TCP with neither a token nor client certificates: "
            "anyone who reaches the port could publish into every engine; set WEIGHTSYNC_TOKEN "
            "(or --token-file), or --tls-cert/--tls-key/--tls-ca, or listen on unix:/path; "
            "--insecure (WEIGHTSYNC_INSECURE=1) only on a network you trust"
        )
    group = None
    if settings.socket_group:
        group = _group_id(settings.socket_group)
    return ServerSecurity(token, credentials, group, root is not None)


def _group_id(name: str) -> int:
    import grp

    try:
        return grp.getgrgid(int(name)).gr_gid if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(
            f"socket_group={name!r} is invalid; expected a group name or id of this machine"
        ) from None


def client_credentials(settings: ClientSettings) -> grpc.ChannelCredentials | None:
    """TLS to the sender when ``WEIGHTSYNC_TLS_CA`` or a client certificate is set; else None.

    Raises:
        ConfigError: an unreadable file, a certificate without its key or the reverse.
    """
    ca, cert, key = settings.tls_ca, settings.tls_cert, settings.tls_key
    if bool(cert) != bool(key):
        raise ConfigError(
            "a client certificate needs both WEIGHTSYNC_TLS_CERT and WEIGHTSYNC_TLS_KEY"
        )
    if not (ca or cert):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "WEIGHTSYNC_TLS_CA") if ca else None,
        private_key=_read(key, "WEIGHTSYNC_TLS_KEY") if key else None,
        certificate_chain=_read(cert, "WEIGHTSYNC_TLS_CERT") if cert else None,
    )


# ---- server: refuse a call without the token --------------------------------------------------

_FIX = "set WEIGHTSYNC_TOKEN (or WEIGHTSYNC_TOKEN_FILE) to the sender's token"
MISSING_TOKEN = (
    f"this weightsync sender requires a token and the call carried none: {_FIX}, which "
    "clients send as 'authorization: Bearer <token>' metadata"
)
WRONG_TOKEN = f"the call's token does not match this weightsync sender's: {_FIX}"


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call (but health and reflection) whose bearer token is not ``token``."""

    def __init__(self, token: str) -> None:
        self._expected = (SCHEME + token).encode()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        given = next((v for k, v in details.invocation_metadata if k == METADATA_KEY), None)
        if given is None:
            return _refusing(handler, MISSING_TOKEN)
        given_bytes = given if isinstance(given, bytes) else given.encode(errors="replace")
        if hmac.compare_digest(given_bytes, self._expected):
            return handler
        return _refusing(handler, WRONG_TOKEN)


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that ends the call UNAUTHENTICATED before reading it
    (a streaming one as well: the client need not send anything first)."""

    def refuse(_request: Any, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return kind(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


# ---- client: send the token on every call -----------------------------------------------------


class BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call of a channel. An interceptor, not
    call credentials: gRPC sends those only over TLS, and a unix socket may carry a token too."""

    def __init__(self, token: str) -> None:
        self._entry = (METADATA_KEY, SCHEME + token)

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            [*(details.metadata or ()), self._entry],
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: Any
