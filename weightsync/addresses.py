"""Control-plane addresses: ``unix:/path`` (also ``unix:///path``) or ``host:port``."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from weightsync.errors import ConfigError


@dataclass(frozen=True)
class Address:
    text: str
    unix_path: str | None = None
    host: str | None = None
    port: int | None = None

    @property
    def grpc_target(self) -> str:
        return f"unix:{self.unix_path}" if self.unix_path else f"{self.host}:{self.port}"

    def with_port(self, port: int) -> Address:
        return Address(f"{self.host}:{port}", host=self.host, port=port)


def parse_address(text: str) -> Address:
    """Parse and validate; raises ConfigError with the accepted forms."""
    if text.startswith("unix:"):
        path = text[len("unix:") :]
        if path.startswith("//"):
            path = path[2:]
        if not path.startswith("/"):
            raise ConfigError(f"address {text!r}: a unix socket path must be absolute")
        return Address(text, unix_path=path)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(
            f"address {text!r} is neither unix:/abs/path nor host:port (e.g. 127.0.0.1:50551)"
        )
    return Address(text, host=host.strip("[]"), port=int(port))


def claim_unix_socket(address: Address) -> None:
    """Refuse a socket path another live sender listens on; remove a stale one.

    gRPC would silently unlink and steal a live socket, leaving the first sender deaf.
    """
    path = address.unix_path
    if path is None or not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise ConfigError(
        f"another process already listens on {address.text}; stop it or pick another --listen"
    )


SocketIdentity = tuple[str, int, int]
"""A unix socket file: (path, st_dev, st_ino)."""


def unix_socket_identity(address: Address) -> SocketIdentity | None:
    """The socket file ``address`` names, as bound now; None for TCP."""
    if address.unix_path is None:
        return None
    st = os.stat(address.unix_path)
    return address.unix_path, st.st_dev, st.st_ino


def remove_unix_socket(identity: SocketIdentity | None) -> None:
    """Remove our socket file at shutdown (gRPC removes only the name it bound, which the
    server moved; see ``weightsync.control.server``), unless another file took the name."""
    if identity is None:
        return
    path, dev, ino = identity
    try:
        st = os.stat(path)
        if (st.st_dev, st.st_ino) == (dev, ino):
            os.unlink(path)
    except FileNotFoundError:
        pass
