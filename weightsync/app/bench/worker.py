"""The receiver process of the bench: one per receiving device, living for the whole run.

It holds one :class:`EngineLikeModel` and serves commands from the trainer process over a
pipe (``torch.multiprocessing`` pickling, so CUDA tensors travel as IPC handles and CPU
tensors as shared memory): receive N versions through a weightsync sender, or play the
receiving side of a peer baseline. After each case it reports its peak extra memory and
compares every packed slice bit for bit with the trainer's shards (mapped from the trainer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch

from weightsync.app.bench.engine_like import EngineLikeModel, EngineLikeTarget
from weightsync.app.bench.layout import TrainerShards, plan_layout
from weightsync.app.bench.models import ModelShape
from weightsync.buckets import BucketPlan, ChunkAssembler, unpack_bucket
from weightsync.errors import ProtocolError, SyncTimeoutError, TransportError


@dataclass(frozen=True)
class SetLayout:
    """The trainer's shards of one layout (mapped here, only read to verify)."""

    tp: int
    flats: list[torch.Tensor]


@dataclass(frozen=True)
class DropLayout:
    """Unmap the shards: the trainer is about to free them."""


@dataclass(frozen=True)
class Receive:
    """Register with the sender at ``address``, apply ``versions`` versions, verify."""

    address: str
    transport: str
    versions: int
    timeout_s: float


@dataclass(frozen=True)
class Finish:
    """The trainer's publishes returned (or failed): disconnect, verify and reply."""


@dataclass(frozen=True)
class PerTensorBaseline:
    """Each version arrives as a list of (name, tensor): one IPC handle per tensor."""

    versions: int


@dataclass(frozen=True)
class BucketBaseline:
    """Buckets of ``plan`` arrive in ``buffers`` (mapped once); each is acked after loading."""

    buffers: list[torch.Tensor]
    plan: BucketPlan
    versions: int


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class CaseReply:
    """What the receiver saw in one case."""

    error: str = ""
    extra_memory_bytes: int | None = None
    """Peak ``torch.cuda.max_memory_allocated`` above the start of the case (None on CPU)."""
    checked: int = 0
    """HF tensors compared bit for bit with the trainer's shards after the last version."""
    mismatches: tuple[str, ...] = field(default_factory=tuple)

    @property
    def bit_exact(self) -> bool:
        return not self.error and self.checked > 0 and not self.mismatches


def memory_start(device: torch.device) -> int:
    """Reset this process's peak-memory counter on ``device``; returns bytes allocated now."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def memory_extra(device: torch.device, start: int) -> int | None:
    """Peak bytes allocated above ``start`` since :func:`memory_start` (None off CUDA)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) - start


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def verify(target: EngineLikeTarget, shards: TrainerShards) -> tuple[int, tuple[str, ...]]:
    """Compare every HF tensor's engine slice with the trainer's bytes; (checked, mismatches)."""
    mismatches = []
    for recipe in shards.layout.recipes:
        expected = shards.assemble(recipe).to(target.device)
        live = target.resolve(recipe.spec.name)
        if not torch.equal(live.view(torch.int16), expected.view(torch.int16)):
            mismatches.append(recipe.spec.name)
    return len(shards.layout.recipes), tuple(mismatches)


def worker_main(conn: Connection, shape: ModelShape, device_name: str) -> None:
    """Entry point of the spawned receiver process."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    target = EngineLikeTarget(EngineLikeModel(shape, device))
    sync(device)
    conn.send("ready")
    shards: TrainerShards | None = None
    while True:
        cmd = conn.recv()
        if isinstance(cmd, Stop):
            return
        if isinstance(cmd, Finish):
            continue  # a case that failed before its receiver started
        if isinstance(cmd, SetLayout):
            shards = TrainerShards(plan_layout(shape, cmd.tp), cmd.flats)
            conn.send("ok")
            continue
        if isinstance(cmd, DropLayout):
            shards = None
            conn.send("ok")
            continue
        conn.send(_run_case(conn, cmd, target, shards))


class _TrainerFinished(ProtocolError):
    """The trainer sent Finish while this receiver still expected data: it gave up."""


def _recv(conn: Connection):
    """The trainer's next message inside a case."""
    msg = conn.recv()
    if isinstance(msg, Finish):
        raise _TrainerFinished("the trainer ended the case early (its row says why)")
    return msg


def _run_case(conn: Connection, cmd, target: EngineLikeTarget, shards) -> CaseReply:
    device = target.device
    start = memory_start(device)
    closers = []
    finished = False  # the trainer already sent Finish
    try:
        if isinstance(cmd, Receive):
            from weightsync.receiver.core import ReceiverCore

            try:
                # A broadcast ("nccl") receiver maps no staging buffer: it names none.
                staging = () if cmd.transport == "nccl" else (cmd.transport,)
                core = ReceiverCore(target, cmd.address, engine="bench", transports=staging)
            except Exception:
                conn.send("failed")  # the trainer waits for a word before publishing
                raise
            conn.send("registered")
            closers.append(core.close)
            for _ in range(cmd.versions):
                _sync_or_finish(conn, core, cmd.timeout_s)
        elif isinstance(cmd, PerTensorBaseline):
            _per_tensor(conn, cmd, target)
        elif isinstance(cmd, BucketBaseline):
            _buckets(conn, cmd, target)
        else:
            raise ProtocolError(f"the bench receiver got an unknown command {cmd!r}")
        extra = memory_extra(device, start)
        checked, mismatches = verify(target, shards) if shards else (0, ())
        reply = CaseReply("", extra, checked, mismatches)
    except Exception as e:  # reported to the trainer, which records it in the case's row
        reply = CaseReply(f"{type(e).__name__}: {e}", memory_extra(device, start))
        finished = isinstance(e, _TrainerFinished)
    # Wait for the trainer's Finish before disconnecting: closing a ReceiverCore cancels its
    # stream at once and could drop the last `applied` still queued for the sender.
    while not finished and not isinstance(conn.recv(), Finish):
        pass
    for close in closers:
        close()
    return reply


def _sync_or_finish(conn: Connection, core, timeout_s: float) -> None:
    """Apply the next version; give up at once when the trainer ends the case (a failed
    publish), rather than waiting ``timeout_s`` for versions that will never come."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            core.sync(timeout=1.0)
            return
        except SyncTimeoutError:
            if conn.poll():
                _recv(conn)  # Finish raises _TrainerFinished
            if time.monotonic() >= deadline:
                raise


def _per_tensor(conn: Connection, cmd: PerTensorBaseline, target: EngineLikeTarget) -> None:
    conn.send("ready")
    for _ in range(cmd.versions):
        # Unpickling opens one IPC handle per tensor storage; dropping them closes it again,
        # as vLLM's colocate example and SGLang's per-tensor update do every version.
        tensors = _recv(conn)
        target.load(tensors)
        sync(target.device)
        del tensors
        conn.send("ack")


def _buckets(conn: Connection, cmd: BucketBaseline, target: EngineLikeTarget) -> None:
    conn.send("ready")
    for _ in range(cmd.versions):
        assembler = ChunkAssembler()
        for _ in cmd.plan.buckets:
            index, slot = _recv(conn)
            bucket = cmd.plan.buckets[index]
            target.load(list(unpack_bucket(cmd.buffers[slot], bucket, assembler)))
            sync(target.device)
            conn.send(index)


class WorkerLink:
    """The trainer's end of a worker's pipe; a dead worker fails a wait at once."""

    def __init__(self, conn: Connection, process: BaseProcess) -> None:
        self.conn, self.process = conn, process
        self._case_running = False

    def send(self, msg: object) -> None:
        self.conn.send(msg)

    def start(self, cmd: Receive | PerTensorBaseline | BucketBaseline) -> None:
        """Start a case; every started case ends with one :meth:`result`."""
        self.conn.send(cmd)
        self._case_running = True

    def result(self, timeout_s: float) -> CaseReply:
        """The case's reply; tells a receiver still inside the case to give up first."""
        if not self._case_running:
            return CaseReply("the case failed before it reached the receiver")
        self._case_running = False
        self.conn.send(Finish())
        while True:  # skip hand-shakes a failed case left unread, so the pipe stays in step
            msg = self.expect(timeout_s, "case result")
            if isinstance(msg, CaseReply):
                return msg

    def expect(self, timeout_s: float, what: str):
        """The worker's next message.

        Raises:
            SyncTimeoutError: nothing within ``timeout_s``. TransportError: the worker died.
        """
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(min(1.0, max(deadline - time.monotonic(), 0.0))):
            if not self.process.is_alive():
                raise TransportError(
                    f"the bench receiver exited (code {self.process.exitcode}) before its {what}"
                )
            if time.monotonic() >= deadline:
                raise SyncTimeoutError(f"the bench receiver sent no {what} in {timeout_s:.0f} s")
        return self.conn.recv()
