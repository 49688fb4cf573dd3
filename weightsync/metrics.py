"""Prometheus metrics of the sender (served on ``metrics_host:metrics_port`` when a port is set).

Besides versions, bytes and per-receiver outcomes: ``weightsync_receivers_connected`` and
``weightsync_publishers_connected``, the streams open right now.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from weightsync.errors import ConfigError


class SenderMetrics:
    """One registry per sender, so several senders (tests) never collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.versions = Counter("weightsync_versions", "versions published", ["state"], registry=r)
        self.bytes = Counter("weightsync_bucket_bytes", "bytes announced in buckets", registry=r)
        self.sync_seconds = Histogram(
            "weightsync_sync_seconds",
            "publish start to every receiver done",
            registry=r,
            buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100),
        )
        self.failures = Counter(
            "weightsync_receiver_failures", "receiver failures", ["receiver"], registry=r
        )
        self.applied = Gauge(
            "weightsync_receiver_applied_version", "version applied", ["receiver"], registry=r
        )
        self.presented = Counter(
            "weightsync_versions_presented",
            "versions whose start went to the receivers ahead of their plan (armed start)",
            registry=r,
        )
        self.last_version = Gauge("weightsync_last_version", "last published version", registry=r)
        self.receivers_connected = Gauge(
            "weightsync_receivers_connected", "receivers with an open stream", registry=r
        )
        self.publishers_connected = Gauge(
            "weightsync_publishers_connected", "publisher ranks with an open stream", registry=r
        )
        self._server = None
        self._thread: threading.Thread | None = None
        self.address: tuple[str, int] | None = None
        """``(host, port)`` the endpoint is bound to, once serving."""

    def serve(self, port: int, host: str = "127.0.0.1") -> tuple[str, int]:
        """Serve ``/metrics`` on ``host:port`` (port 0: a free one); returns what was bound.

        Raises:
            ConfigError: the port is in use, or the host is not an address of this machine.
        """
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            why = e.strerror or str(e)
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {why}; pick a free --metrics-port "
                "(WEIGHTSYNC_METRICS_PORT) or another --metrics-host (WEIGHTSYNC_METRICS_HOST)"
            ) from None
        self.address = (host, self._server.server_address[1])
        return self.address

    def close(self) -> None:
        """Stop serving (no-op when not serving)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def version_started(self, version: int) -> None:
        self.last_version.set(version)

    def version_presented(self) -> None:
        self.presented.inc()

    def bucket_announced(self, nbytes: int) -> None:
        self.bytes.inc(nbytes)

    def receiver_applied(self, receiver_id: str, version: int) -> None:
        self.applied.labels(receiver_id).set(version)

    def receiver_failed(self, receiver_id: str) -> None:
        self.failures.labels(receiver_id).inc()

    def receiver_forgotten(self, receiver_id: str) -> None:
        """Drop a receiver's series once Status forgets it: engines restarted under new ids
        would otherwise grow the endpoint forever."""
        for metric in (self.applied, self.failures):
            try:
                metric.remove(receiver_id)
            except KeyError:
                pass  # it never applied, or never failed

    def version_done(self, state: str, complete_s: float) -> None:
        self.versions.labels(state).inc()
        self.sync_seconds.observe(complete_s)

    def set_receivers_connected(self, n: int) -> None:
        self.receivers_connected.set(n)

    def set_publishers_connected(self, n: int) -> None:
        self.publishers_connected.set(n)
