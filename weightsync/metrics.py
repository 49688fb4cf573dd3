"""Prometheus metrics of the sender (served on ``metrics_port`` when set)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


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
        self.last_version = Gauge("weightsync_last_version", "last published version", registry=r)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)

    def version_started(self, version: int) -> None:
        self.last_version.set(version)

    def bucket_announced(self, nbytes: int) -> None:
        self.bytes.inc(nbytes)

    def receiver_applied(self, receiver_id: str, version: int) -> None:
        self.applied.labels(receiver_id).set(version)

    def receiver_failed(self, receiver_id: str) -> None:
        self.failures.labels(receiver_id).inc()

    def version_done(self, state: str, complete_s: float) -> None:
        self.versions.labels(state).inc()
        self.sync_seconds.observe(complete_s)
