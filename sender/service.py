"""The gRPC servicer: moves messages between streams and the coordinator, nothing more."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator

import grpc

from weightsync import trace
from weightsync.control.lanes import Lane, LaneClosed, LaneServer, switched
from weightsync.errors import (
    ConfigError,
    ProtocolError,
    WeightSyncError,
    grpc_code_for,
    rpc_details,
)
from weightsync.limits import (
    MAX_VERSION,
    check_publisher_message,
    check_receiver_message,
)
from weightsync.sender.coordinator import Coordinator
from weightsync.sender.joins import StreamBegins
from weightsync.sender.outbox import Outbox, Unsent, batched
from weightsync.sender.packing import received_sources
from weightsync.sender.read_ahead import ReadAhead
from weightsync.sender.records import PublisherConn, RankConn, ReceiverConn
from weightsync.sender.version import Version
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.v1 import weightsync_pb2_grpc as pb_grpc

log = logging.getLogger("weightsync.sender")


def _first(requests: Iterator, kind: str, context: grpc.ServicerContext, timeout_s: float):
    """The stream's first message, which must be a ``kind``; a stream that sends nothing for
    ``timeout_s`` is closed (a mute stream would hold its thread and stream slot forever)."""
    got: queue.Queue = queue.Queue(maxsize=1)

    def read() -> None:
        try:
            got.put((next(requests), None))
        except StopIteration:
            got.put((None, None))
        except Exception as e:  # noqa: BLE001 - raised again on the stream's own thread
            got.put((None, e))

    # Its own thread: the stream's wait for a message cannot time out. Aborted, the stream
    # ends, and so does this thread's wait.
    threading.Thread(target=read, daemon=True, name=f"weightsync-{kind}").start()
    try:
        msg, error = got.get(timeout=timeout_s)
    except queue.Empty:
        context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"no {kind} within {timeout_s:g} s of opening the stream (hello_timeout_s, "
            "WEIGHTSYNC_HELLO_TIMEOUT_S); the stream is closed: open a new one and send the "
            f"{kind} first",
        )
    if error is not None:
        raise error
    if msg is None:
        context.abort(grpc.StatusCode.CANCELLED, f"peer closed the stream before sending {kind}")
    got = msg.WhichOneof("kind")
    if got is None:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"ConfigError: expected a {kind} message first, got a {type(msg).__name__} with "
            f"no kind set; send the {kind} first",
        )
    if got != kind:
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"ProtocolError: expected a {kind} message first, got a message of kind {got!r}; "
            f"send the {kind} first",
        )
    return getattr(msg, kind)


_GONE_GRACE_S = 1.0
"""How long after a receiver's call ended its reader has to hand over the message it took
off the stream before the receiver is ended in the registry without it."""


def _abort(context: grpc.ServicerContext, error: WeightSyncError):
    context.abort(grpc_code_for(error), rpc_details(error))


MAX_BATCH = 64
"""Announcements sent in one message at most."""
_MORE = object()
_LANE = object()
"""Queued in a stream's outbox once its client took its lane: the switch goes in order."""


class _Outgoing:
    """Where a stream's messages to its client go: yielded to gRPC until the client took the
    lane it was offered (``lanes.py``), then written to that lane."""

    def __init__(self, lanes: LaneServer | None, wanted: bool, outbox: Outbox, conn) -> None:
        self.lane: Lane | None = None
        self._outbox, self._conn = outbox, conn
        self.offer = lanes.offer(self._attach, self._switch) if lanes and wanted else None
        self._lanes = lanes

    def _attach(self, lane: Lane) -> None:
        self.lane = lane

    def take_fds(self) -> list[int]:
        """The descriptors that came with the client's last message (gRPC carries none)."""
        return self.lane.take_fds() if self.lane is not None else []

    def _switch(self) -> None:
        self._outbox.put(_LANE)

    def incoming(self, requests: Iterator, cls) -> Iterator:
        """The client's messages after its hello, from gRPC or, once it switched, its lane."""
        return switched(requests, lambda: self.lane, cls)

    def deliver(self, messages: Iterator, switch) -> Iterator:
        """Yield ``messages`` to gRPC; from :data:`_LANE` on, send ``switch`` there and the
        rest on the lane. The lane is closed when the stream ends, however it ends."""
        on_lane = False
        try:
            for msg in messages:
                if msg is _LANE:
                    yield switch
                    on_lane = self._conn.lane = True
                elif not on_lane:
                    yield msg
                    continue
                elif isinstance(msg, Unsent):
                    self.lane.send_bytes(msg)
                else:
                    self.lane.send(msg)
                self._outbox.direct(self.lane)
        except LaneClosed:
            return  # the client's end of the lane is gone: so is the client (its reader says)
        finally:
            self._outbox.queued()
            if self.offer is not None:
                self._lanes.withdraw(self.offer)
            if self.lane is not None:
                self.lane.close()


def take_queued(
    outbox: queue.Queue, most: int
) -> tuple[list[pb.Announcement], WeightSyncError | object | None]:
    """The announcements to send next: the first to come, and up to ``most`` in all of those
    queued behind it, with what stopped the take: an error to end the stream with, None (the
    stream is over) or another sentinel (take again). A list queued (``Registry.together``)
    is taken whole, whatever ``most``."""
    items: list[pb.Announcement] = []
    item = outbox.get()
    while isinstance(item, (pb.Announcement, list)):
        if isinstance(item, list):
            items.extend(item)
        else:
            items.append(item)
        if len(items) >= most:
            return items, _MORE
        try:
            item = outbox.get_nowait()
        except queue.Empty:
            return items, _MORE
    return items, item


class WeightSyncServicer(pb_grpc.WeightSyncServicer):
    def __init__(self, coordinator: Coordinator, lanes: LaneServer | None = None) -> None:
        self._co = coordinator
        self._lanes = lanes
        """Offered to the clients that say they take lanes (None: lanes are off)."""

    def Publish(self, request_iterator, context):
        """One stream per publisher rank, carrying its versions one after another (a new
        stream per version cost milliseconds of setup)."""
        hello = _first(request_iterator, "hello", context, self._co.settings.hello_timeout_s)
        try:
            pconn = self._co.publisher_connected(hello)
        except WeightSyncError as e:
            _abort(context, e)
        except Exception as e:  # never leave a stream without an answer
            _abort(context, ConfigError(f"PublisherHello refused: {type(e).__name__}: {e}"))
        context.add_callback(lambda: self._co.publisher_left(pconn, "disconnected"))
        outbox = Outbox()
        out = _Outgoing(self._lanes, hello.lanes, outbox, pconn)
        requests = out.incoming(request_iterator, pb.PublisherMessage)
        threading.Thread(
            target=self._consume_publisher,
            args=(hello, pconn, requests, outbox, out.take_fds),
            daemon=True,
        ).start()
        welcome = pb.PublisherWelcome(
            bucket_size_bytes=self._co.settings.bucket_size_bytes,
            transport=self._co.settings.transport,
            last_version=self._co.last_version,
            begin_keys=True,
            ready_events=True,
            lane=out.offer,
        )
        yield from out.deliver(
            self._replies(welcome, outbox, context), pb.SenderReply(lane=pb.LaneSwitch())
        )

    @staticmethod
    def _replies(welcome: pb.PublisherWelcome, outbox: queue.Queue, context) -> Iterator:
        yield pb.SenderReply(welcome=welcome)
        while True:
            item = outbox.get()
            if item is None:
                return
            if isinstance(item, WeightSyncError):
                _abort(context, item)
            yield item

    def _consume_publisher(
        self,
        hello: pb.PublisherHello,
        pconn: PublisherConn,
        requests,
        outbox: queue.Queue,
        take_fds: Callable[[], list[int]],
    ) -> None:
        """Read a publisher rank's stream: each ``begin`` joins a version, ``packed`` and
        ``error`` belong to the latest one. Whatever happens, the stream gets an answer and
        the rank is left nowhere once it ends; a message refused ends the stream with its
        error and abandons the version it was packing."""
        version, run, rank = 0, None, None
        begins = StreamBegins()
        why = "closed its stream"
        left: WeightSyncError = ProtocolError(f"publisher rank {hello.rank} closed its stream")
        try:
            for msg in requests:
                kind = check_publisher_message(msg)
                if kind == "begin":
                    self._check_previous_over(hello, version, run, rank, msg.begin)
                    version = msg.begin.manifest.version
                    run, rank = None, None
                    # The descriptors of its offered shm files came with it (on a lane).
                    begins.received = received_sources(msg.begin, take_fds(), hello.rank)
                    run, rank = self._co.join(hello, msg.begin, outbox, begins)
                    continue
                # Ranks that joined before the last one got no run; it exists by their packing.
                current = run or self._co.run_of(version)
                if current is None or rank is None:
                    continue
                if kind == "packed":
                    self._co.on_packed(current, rank, msg.packed)
                elif kind == "error":
                    self._co.publisher_failed(current, msg.error)
        except WeightSyncError as e:
            why = f"refused: {e}"
            left = e
            outbox.put(e)
        except grpc.RpcError:
            why = "its stream broke"
        except Exception as e:  # a bug: answer the stream rather than leave it hanging
            why = f"{type(e).__name__}: {e}"
            log.exception("publisher rank %d: stream failed", hello.rank)
            outbox.put(WeightSyncError(f"the sender failed on this stream: {why}"))
        finally:
            try:
                self._co.rank_left(hello, version, rank)
                current = run or (self._co.run_of(version) if rank is not None else None)
                if current is not None:
                    self._co.publisher_failed(current, left)
            finally:
                self._co.publisher_left(pconn, why)
                outbox.put(None)

    def _check_previous_over(
        self,
        hello: pb.PublisherHello,
        version: int,
        run: Version | None,
        rank: RankConn | None,
        begin: pb.BeginVersion,
    ) -> None:
        """A rank begins its next version only once its last is staged or over: a second
        ``begin`` mid-version would leave the first waiting for packing that never comes."""
        if rank is None:
            return  # it took part in no version on this stream (or its begin was refused)
        current = run or self._co.run_of(version)
        if current is not None and (current.staged_s or current.done):
            return
        raise ProtocolError(
            f"BeginVersion of version {begin.manifest.version} arrived on publisher rank "
            f"{hello.rank}'s stream while its version {version} is still "
            f"{'joining' if current is None else 'packing'}; send the next begin after "
            "`staged` (version abandoned)"
        )

    def Receive(self, request_iterator, context):
        hello = _first(request_iterator, "hello", context, self._co.settings.hello_timeout_s)
        try:
            conn = self._co.add_receiver(hello)
        except WeightSyncError as e:
            _abort(context, e)
        context.add_callback(lambda: self._gone_later(conn))
        out = _Outgoing(self._lanes, hello.lanes, conn.outbox, conn)
        # Read one ahead only what comes by gRPC: a lane keeps what the receiver wrote before it
        # cancelled, so its messages are handled on the reading thread, a thread hop sooner.
        ahead = ReadAhead(request_iterator, f"weightsync-receiver-{conn.receiver_id}")
        requests = out.incoming(ahead, pb.ReceiverMessage)
        threading.Thread(
            target=self._consume_receiver, args=(conn, requests, ahead), daemon=True
        ).start()
        welcome = pb.ReceiverWelcome(
            receiver_id=conn.receiver_id,
            keeps_keys=True,
            takes_writes=True,
            acks_in_applied=True,
            lane=out.offer,
        )
        yield from out.deliver(
            self._announcements(conn, welcome, context), pb.Announcement(lane=pb.LaneSwitch())
        )

    def _gone_later(self, conn: ReceiverConn) -> None:
        """The receiver's call ended. Its reader ends it in the registry once it handled the
        message it had taken off the stream (a receiver that sent ``applied`` and cancelled
        its call at once is applied, not failed by its leaving); failing it here first lost
        that message. A reader that does not end (stuck on a lane whose peer is stopped) is
        overtaken after :data:`_GONE_GRACE_S`."""
        timer = threading.Timer(_GONE_GRACE_S, self._co.receiver_gone, (conn, "disconnected"))
        timer.daemon = True
        timer.start()

    @staticmethod
    def _announcements(conn: ReceiverConn, welcome: pb.ReceiverWelcome, context) -> Iterator:
        yield pb.Announcement(welcome=welcome)
        while True:
            items, end = take_queued(conn.outbox, MAX_BATCH if conn.batches else 1)
            if items:
                if trace.enabled:
                    kinds = ",".join(item.WhichOneof("kind") for item in items)
                    trace.mark("sender.yield", receiver=conn.receiver_id, kind=kinds)
                yield batched(items)
            if end is None:
                return
            if end is _LANE or isinstance(end, Unsent):
                yield end
            elif isinstance(end, WeightSyncError):
                _abort(context, end)

    def _consume_receiver(self, conn: ReceiverConn, requests, ahead: ReadAhead) -> None:
        """Read a receiver's stream (its gRPC part one message ahead of handling it, so that
        one sent just before the call was cancelled is not lost); a message refused ends it
        with the error (the receiver fails in its versions at once rather than at the ack
        timeout of each)."""
        why = "closed its stream"
        try:
            for msg in requests:
                check_receiver_message(msg)
                self._co.on_receiver_message(conn, msg)
        except WeightSyncError as e:
            why = f"refused: {e}"
            conn.outbox.put(e)
        except grpc.RpcError:
            why = "disconnected"  # its call was cancelled or broke
        except Exception as e:
            why = f"the sender failed on its message: {type(e).__name__}: {e}"
            log.exception("receiver %s: stream failed", conn.receiver_id)
        finally:
            ahead.stop()
            self._co.receiver_gone(conn, why)

    def Status(self, request, context):
        return self._co.status()

    def WaitApplied(self, request, context):
        try:
            if request.version > MAX_VERSION:
                raise ConfigError(
                    f"WaitAppliedRequest.version {request.version} is out of range; versions "
                    f"are 1..{MAX_VERSION}"
                )
            if not request.timeout_s >= 0:  # NaN too
                raise ConfigError(
                    f"WaitAppliedRequest.timeout_s {request.timeout_s} must be >= 0 "
                    "(0: until the call's deadline)"
                )
        except WeightSyncError as e:
            _abort(context, e)
        timeout = request.timeout_s
        if context.time_remaining() is not None:
            timeout = min(timeout or context.time_remaining(), context.time_remaining())
        try:
            status = self._co.wait_applied(request.version, timeout, alive=context.is_active)
        except WeightSyncError as e:
            _abort(context, e)
        return pb.WaitAppliedReply(version=status)
