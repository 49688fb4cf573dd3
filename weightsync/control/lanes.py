"""Same-host lanes: a stream's messages over a Unix socket instead of the gRPC stream.

A one-way hop of a Python gRPC stream costs 0.2-0.8 ms (each message crosses gRPC's threads),
and a version's control path takes five in a row: on one GPU that was most of the gap between
a sync and one flat copy of its bytes. A lane is a plain socket read by one thread, ~20 us a
hop. The protocol is in ``proto/weightsync/v1/weightsync.proto`` (``LaneOffer``): the gRPC
stream stays open beside the lane and still says whether the peer is alive, and either one
ending ends both.

:class:`LaneServer` is the sender's end (it offers lanes and takes the connections),
:class:`ClientStream` a client's, :func:`switched` reads a stream's messages on both sides.
"""

from __future__ import annotations

import array
import logging
import os
import queue
import secrets
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from weightsync import trace
from weightsync.errors import ProtocolError
from weightsync.v1 import weightsync_pb2 as pb

log = logging.getLogger("weightsync.lanes")

MAX_FRAME_BYTES = 256 * 1024 * 1024
"""The largest message a lane carries: gRPC's limit on the same streams (``server.py``)."""
MAX_FRAME_FDS = 1 << 12
"""Descriptors one frame may carry (``limits.MAX_SOURCES``: one per offered storage); more
close the lane."""
_FDS_PER_SENDMSG = 253
"""Linux's ``SCM_MAX_FD``: descriptors one ``sendmsg`` may pass."""
_ANCILLARY = socket.CMSG_SPACE(_FDS_PER_SENDMSG * array.array("i").itemsize)
_HEADER = struct.Struct("<I")
_TAKEN = b"\x01"
_HANDSHAKE_S = 5.0
"""How long either end waits for the other during a lane's handshake."""
_GRPC_END_S = 2.0
"""How long a reader whose lane ended waits for the gRPC stream's end, which says why (an
error the peer ended the stream with arrives there, not on the lane)."""

M = TypeVar("M")


class LaneClosed(Exception):
    """The lane ended or broke (internal: readers end, writers drop the message)."""


class Lane:
    """One stream's socket: framed protobuf messages, written by any thread, read by one.

    A frame may carry open file descriptors (``SCM_RIGHTS``): a publisher proves it can open
    the memory it offers by passing it (protocol §1.1). The reader reads exactly one frame at
    a time, so the descriptors it receives are that frame's; :meth:`take_fds` hands them over,
    and those not taken are closed before the next frame is read."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(None)
        self._sock = sock
        self._write = threading.Lock()
        self._fds: list[int] = []
        """Descriptors that came with the frame read last (the reader's thread only)."""

    def send(self, msg, fds: Sequence[int] = ()) -> None:
        """Write ``msg`` as one frame, with ``fds`` passed along; raises LaneClosed when the
        lane is gone."""
        frame = _frame(msg.SerializeToString())
        if fds:
            self._send_with_fds(frame, fds)
        else:
            self.send_bytes(frame)
        if trace.enabled:
            trace.mark("lane.sent", kind=msg.WhichOneof("kind"))

    def _send_with_fds(self, frame: bytes, fds: Sequence[int]) -> None:
        # One sendmsg passes at most 253 descriptors: each group rides on the next byte of the
        # frame, the last one on the rest (the reader gathers all of a frame's).
        groups = [fds[i : i + _FDS_PER_SENDMSG] for i in range(0, len(fds), _FDS_PER_SENDMSG)]
        if len(groups) > len(frame):
            raise ValueError(f"{len(fds)} descriptors cannot go with a {len(frame)}-byte frame")
        try:
            with self._write:
                pos = 0
                for i, group in enumerate(groups):
                    end = len(frame) if i == len(groups) - 1 else pos + 1
                    pos += socket.send_fds(self._sock, [frame[pos:end]], list(group))
                self._sock.sendall(frame[pos:])
        except OSError as e:
            raise LaneClosed(str(e)) from None

    def take_fds(self) -> list[int]:
        """The descriptors that came with the message read last; the caller closes them."""
        fds, self._fds = self._fds, []
        return fds

    def try_send(self, msg) -> bytes | None:
        """Write ``msg`` as one frame without blocking; returns the part of the frame the
        socket did not take (to :meth:`send_bytes` before anything else), None when it took
        it all. Raises LaneClosed when the lane is gone."""
        frame = _frame(msg.SerializeToString())
        try:
            with self._write:
                sent = self._sock.send(frame, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            raise LaneClosed(str(e)) from None
        return None if sent == len(frame) else frame[sent:]

    def send_bytes(self, data: bytes) -> None:
        """Write ``data`` whole (a frame, or what :meth:`try_send` left of one); raises
        LaneClosed when the lane is gone."""
        try:
            with self._write:
                self._sock.sendall(data)
        except OSError as e:
            raise LaneClosed(str(e)) from None

    def messages(self, cls: Callable[[], M]) -> Iterator[M]:
        """The peer's messages until it closes the lane (or it breaks)."""
        try:
            while True:
                self._close_fds()
                try:
                    data = self._read_frame()
                except (OSError, ValueError, LaneClosed):
                    return
                if trace.enabled:
                    trace.mark("lane.read", nbytes=len(data))
                msg = cls()
                msg.ParseFromString(data)
                yield msg
        finally:
            self._close_fds()

    def _close_fds(self) -> None:
        for fd in self.take_fds():
            os.close(fd)

    def _read_frame(self) -> bytes:
        (size,) = _HEADER.unpack(self._read_exactly(_HEADER.size))
        if size > MAX_FRAME_BYTES:
            raise LaneClosed(f"a frame of {size} bytes, over the limit of {MAX_FRAME_BYTES}")
        return self._read_exactly(size)

    def _read_exactly(self, size: int) -> bytes:
        """``size`` bytes, never more: a descriptor sent with the next frame stays unread."""
        data = bytearray(size)
        view, got = memoryview(data), 0
        while got < size:
            n, ancillary, flags, _ = self._sock.recvmsg_into([view[got:]], _ANCILLARY)
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                    self._fds.extend(fds)
            if flags & socket.MSG_CTRUNC or len(self._fds) > MAX_FRAME_FDS:
                raise LaneClosed(f"a frame with more than {MAX_FRAME_FDS} descriptors")
            if n == 0:
                raise LaneClosed("end of lane inside a frame" if got else "end of lane")
            got += n
        return bytes(data)

    def close_read(self) -> None:
        """Read no more than the peer already sent: this end's reader gets those frames, then
        the end (it wakes if it waits); the peer's further writes fail."""
        try:
            self._sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def close_write(self) -> None:
        """No more messages from this end: the peer reads what was sent, then the end."""
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        """End the lane both ways (wakes this end's reader)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _frame(data: bytes) -> bytes:
    return _HEADER.pack(len(data)) + data


class LaneServer:
    """The sender's lanes: a Unix socket in a directory of its own (0700: only this user's
    processes reach it), and a one-time token per stream offered one."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="ws-lanes-")
        self.path = os.path.join(self._dir, "s")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._lock = threading.Lock()
        self._offers: dict[bytes, tuple[Callable[[Lane], None], Callable[[], None]]] = {}
        self._closed = False
        threading.Thread(target=self._accept, name="lanes", daemon=True).start()

    def offer(self, attach: Callable[[Lane], None], switch: Callable[[], None]) -> pb.LaneOffer:
        """A lane for one stream. Once its client connected (on a lane thread): ``attach(lane)``
        before the client hears the lane was taken (its messages may come by it from then on),
        ``switch()`` after (the sender's may: none may reach the socket before that byte).
        Withdraw it when the stream ends."""
        token = secrets.token_bytes(16)
        with self._lock:
            self._offers[token] = (attach, switch)
        return pb.LaneOffer(path=self.path, token=token)

    def withdraw(self, offer: pb.LaneOffer) -> None:
        with self._lock:
            self._offers.pop(offer.token, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._offers.clear()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handshake, args=(sock,), daemon=True).start()

    def _handshake(self, sock: socket.socket) -> None:
        """Read the client's token; a known one takes its stream's lane, anything else is
        dropped (the client then stays on gRPC)."""
        sock.settimeout(_HANDSHAKE_S)
        try:
            # Exact reads, not a buffered file: nothing of the lane's may be read ahead here.
            header = sock.recv(_HEADER.size, socket.MSG_WAITALL)
            (size,) = _HEADER.unpack(header) if len(header) == _HEADER.size else (-1,)
            token = sock.recv(size, socket.MSG_WAITALL) if 0 < size <= 64 else b""
        except OSError:
            token = b""
        if not token:
            sock.close()
            return
        with self._lock:
            callbacks = None if self._closed else self._offers.pop(token, None)
        if callbacks is None:
            sock.close()
            return
        attach, switch = callbacks
        lane = Lane(sock)
        attach(lane)
        try:
            sock.sendall(_TAKEN)
        except OSError:
            lane.close()
            return
        switch()


def connect_lane(offer: pb.LaneOffer) -> Lane | None:
    """The client's end of an offered lane, or None (then the stream stays on gRPC): the
    sender's socket may be out of reach (another host, another mount namespace or user)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(_HANDSHAKE_S)
    try:
        sock.connect(offer.path)
        sock.sendall(_frame(offer.token))
        if sock.recv(1) != _TAKEN:
            raise OSError("the sender did not take the lane")
    except OSError as e:
        log.info("no lane to the sender at %s (%s): staying on gRPC", offer.path, e)
        sock.close()
        return None
    return Lane(sock)


def switched(messages: Iterator[M], lane: Callable[[], Lane | None], cls) -> Iterator[M]:
    """A stream's incoming messages: from gRPC (``messages``) up to the peer's ``lane``
    switch, then from ``lane()``. A thread then watches the gRPC stream: its end ends the
    lane (what the peer wrote before is still read: a message the peer sent just before it
    cancelled its call is not lost), and an error it ended with is raised here once the lane is
    over."""
    for msg in messages:
        if msg.WhichOneof("kind") != "lane":
            yield msg
            continue
        taken = lane()
        if taken is None:
            raise ProtocolError("the peer switched its stream to a lane it never took")
        ended = _GrpcEnd(messages, taken)
        try:
            yield from taken.messages(cls)
        finally:
            ended.read.set()
        ended.raise_error()
        return


class _GrpcEnd:
    """Waits for a gRPC stream whose messages moved to ``lane``, then ends the lane's reading
    (its reader still gets the frames already sent) and closes it once they are read."""

    def __init__(self, messages: Iterator, lane: Lane) -> None:
        self._messages, self._lane = messages, lane
        self._error: Exception | None = None
        self._done = threading.Event()
        self.read = threading.Event()
        """Set when the lane's reader is done (it read to the lane's end, or stopped)."""
        threading.Thread(target=self._watch, name="lane-grpc", daemon=True).start()

    def _watch(self) -> None:
        try:
            for msg in self._messages:
                self._error = ProtocolError(
                    f"a {msg.WhichOneof('kind')} message came by gRPC after the switch to a lane"
                )
                break
        except Exception as e:  # the stream's end, as gRPC reports it
            self._error = e
        finally:
            self._done.set()
            self._lane.close_read()
            self.read.wait(_GRPC_END_S)  # a reader that does not drain is cut off after it
            self._lane.close()

    def raise_error(self) -> None:
        """Raise what the gRPC stream ended with, if it ended in an error."""
        self._done.wait(_GRPC_END_S)
        if self._error is not None:
            raise self._error


class ClientStream:
    """A client's bidirectional stream: its messages go by gRPC until it takes the lane the
    sender offered (:meth:`take_lane`), then by the lane; ``replies`` are the sender's, from
    wherever they come (:func:`switched`)."""

    def __init__(self, open_call: Callable[[Iterator], Iterator], first, reply_cls) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._requests.put(first)
        self._switch = type(first)(lane=pb.LaneSwitch())
        self._lock = threading.Lock()
        """Orders the switch among messages sent from other threads."""
        self.call = open_call(iter(self._requests.get, None))
        """The gRPC call (``cancel``, ``done``)."""
        self.lane: Lane | None = None
        self.replies: Iterator = switched(self.call, lambda: self.lane, reply_cls)

    def take_lane(self, offer: pb.LaneOffer) -> None:
        """Move the messages to the lane ``offer`` names (a ``lane`` message on gRPC marks
        where); stays on gRPC when it cannot be reached."""
        lane = connect_lane(offer)
        if lane is not None:
            with self._lock:
                self._requests.put(self._switch)
                self.lane = lane

    def send(self, msg, fds: Sequence[int] = ()) -> None:
        """Queue ``msg`` (delivered in order; on a broken lane dropped: the replies end).
        ``fds`` go with it on a lane; gRPC carries none."""
        with self._lock:
            lane = self.lane
            if lane is None:
                self._requests.put(msg)
                return
        try:
            lane.send(msg, fds)
        except LaneClosed:
            pass

    def end(self) -> None:
        """No more messages: the sender reads what was sent, then the stream's end."""
        self._requests.put(None)
        if self.lane is not None:
            self.lane.close_write()

    def cancel(self) -> None:
        self.call.cancel()
        if self.lane is not None:
            self.lane.close()
