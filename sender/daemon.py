"""``weightsync.sender.Sender``: the daemon beside a trainer; hosts control plane and staging."""

from __future__ import annotations

import threading

from weightsync.addresses import parse_address, remove_unix_socket, unix_socket_identity
from weightsync.config import SenderSettings
from weightsync.control.auth import server_security
from weightsync.control.lanes import LaneServer
from weightsync.control.server import create_server
from weightsync.metrics import SenderMetrics
from weightsync.sender.coordinator import Coordinator
from weightsync.sender.service import WeightSyncServicer
from weightsync.transports.shm import claim_staging
from weightsync.v1 import weightsync_pb2_grpc as pb_grpc

_SIGNAL_POLL_S = 0.2
"""How soon :meth:`Sender.wait` sees ``stop`` set (by a signal, whichever thread got it)."""


class Sender:
    """Hosts the gRPC control plane and the staging buffers.

    Args:
        listen: ``unix:/path`` or ``host:port`` (``host:0`` picks a free port; see ``address``).
        **settings: any :class:`~weightsync.config.SenderSettings` field (bucket_size_bytes,
            num_buffers, transport, ack_timeout_s, ...); unset fields come from
            ``WEIGHTSYNC_*`` env vars, then defaults.

    A TCP ``listen`` needs a token (``WEIGHTSYNC_TOKEN`` / ``token_file``) or TLS
    (``tls_cert``, ``tls_key``, ``tls_ca``), or ``insecure=True``; see ``docs/security.md``.

    Raises:
        ConfigError: a malformed address or one already in use, an invalid setting, or TCP
            with neither token nor TLS (and not ``insecure``).

    Use as a context manager, or call ``close()``.
    """

    def __init__(self, listen: str | None = None, **settings) -> None:
        if listen is not None:
            settings["listen"] = listen
        self.settings = SenderSettings(**settings)
        # Before anything listens: TCP open to anyone is refused unless asked for.
        security = server_security(self.settings, parse_address(self.settings.listen))
        self.metrics = SenderMetrics()
        if self.settings.metrics_port:  # first: a busy port fails before anything else is up
            self.metrics.serve(self.settings.metrics_port, self.settings.metrics_host)
        self._lanes: LaneServer | None = None
        try:
            # Before any staging exists: a predecessor on this address killed with -9 left its
            # shm segments behind; they are ours to remove.
            claim_staging(self.settings.listen)
            self.coordinator = Coordinator(self.settings, self.metrics)
            self._lanes = LaneServer() if self.settings.lanes else None
            servicer = WeightSyncServicer(self.coordinator, self._lanes)
            self._server, bound, self._health = create_server(
                self.settings.listen,
                lambda s: pb_grpc.add_WeightSyncServicer_to_server(servicer, s),
                max_streams=self.settings.max_streams,
                security=security,
            )
        except BaseException:
            self.metrics.close()
            if self._lanes is not None:
                self._lanes.close()
            raise
        self.address = bound.text
        self.protection = security.describe(bound)
        """How clients must prove themselves, in words (for the startup log line)."""
        self._socket = unix_socket_identity(bound)
        self._server.start()
        self._closed = threading.Event()

    def wait(self, stop: threading.Event | None = None) -> None:
        """Serve until ``close()``, or until ``stop`` is set (the CLI's SIGINT/SIGTERM
        handlers set it), then close."""
        # Python runs a signal's handler on the main thread, once it runs bytecode: a signal
        # the kernel hands to another thread (gRPC's, CUDA's) does not end an untimed wait,
        # and the sender ignored SIGTERM after a version staged on a GPU.
        while not self._closed.wait(_SIGNAL_POLL_S):
            if stop is not None and stop.is_set():
                self.close()

    def close(self, grace_s: float = 1.0) -> None:
        if self._closed.is_set():
            return
        self._health.enter_graceful_shutdown()
        self.coordinator.close()
        self._server.stop(grace_s).wait()
        if self._lanes is not None:
            self._lanes.close()
        remove_unix_socket(self._socket)
        self.metrics.close()
        self._closed.set()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
