"""The sender's cap on open streams, refused in words.

Every Publish or Receive stream holds a server thread for its whole life. Past the cap gRPC
itself refuses any call with a bare RESOURCE_EXHAUSTED, health checks included, which a client
can only take for a sender that is not there. So the cap on streams is enforced here, below
gRPC's own limit by :data:`SPARE_CALLS`: a full sender still answers health checks and
``Status``, and a refused stream is told why and what to do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc

from weightsync.errors import TransportError, rpc_details

SPARE_CALLS = 32
"""Calls served beyond the stream cap: health checks, Status, WaitApplied, a refusal."""


def stream_limit_message(max_streams: int) -> str:
    return (
        f"the sender is at its stream limit ({max_streams} streams: publisher ranks and "
        "receivers); close clients that are done (a publisher or receiver left open holds "
        "one), or start the sender with a higher WEIGHTSYNC_MAX_STREAMS"
    )


class StreamLimit(grpc.ServerInterceptor):
    """Refuses a bidirectional stream of ``service`` past ``max_streams`` open ones with
    RESOURCE_EXHAUSTED and :func:`stream_limit_message`; other calls pass uncounted."""

    def __init__(self, service: str, max_streams: int) -> None:
        self._prefix = f"/{service}/"
        self._max = max_streams
        self._open = 0
        self._lock = threading.Lock()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if (
            handler is None
            or handler.stream_stream is None
            or not details.method.startswith(self._prefix)
        ):
            return handler
        return grpc.stream_stream_rpc_method_handler(
            self._counted(handler.stream_stream),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _counted(self, behavior: Callable) -> Callable:
        def counted(requests: Iterator, context: grpc.ServicerContext) -> Iterator:
            with self._lock:
                full = self._open >= self._max
                if not full:
                    self._open += 1
            if full:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    rpc_details(TransportError(stream_limit_message(self._max))),
                )
            # Runs when the call ends, however it ends (add_callback is False if it already did).
            if not context.add_callback(self._release):
                self._release()
            yield from behavior(requests, context)

        return counted

    def _release(self) -> None:
        with self._lock:
            self._open -= 1
