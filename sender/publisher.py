"""``Publisher``: publish HF-named tensors from any process (a trainer rank) to a sender."""

from __future__ import annotations

import os
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc
import torch

from weightsync import gc_pause, trace
from weightsync.buckets import Bucket, pack_entry
from weightsync.checksum import verify_entry
from weightsync.config import ClientSettings
from weightsync.control.client import connect
from weightsync.errors import (
    ConfigError,
    ReceiverFailedError,
    SyncTimeoutError,
    WeightSyncError,
    error_from_rpc,
)
from weightsync.exports import Exports
from weightsync.manifest import LoraAdapterSpec, VersionManifest, VersionPartSpec
from weightsync.regions import Region
from weightsync.sender.placement import Published, ReadyCheck, WireManifest, placed
from weightsync.sender.publish_stream import PublishStream
from weightsync.sender.states import OutcomeState
from weightsync.transports import MappedBuffers
from weightsync.transports.cuda_ipc import device_uuid, named_events, wait_for_streams
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import (
    ParseCache,
    bucket_from_pb,
    describe,
    error_to_pb,
)

PackFn = Callable[[Bucket, torch.Tensor], None]
"""Writes this rank's bytes of ``bucket`` into the mapped staging buffer (flat uint8)."""


@dataclass(frozen=True)
class PublishResult:
    version: int
    staged_s: float
    """Seconds until every byte was out of trainer memory (the trainer may step again); with
    ``wait=True``, as the sender measured it from the version's start (``done`` tells both)."""
    receivers: int
    """How many receivers the version was addressed to."""
    status: pb.VersionStatus | None = None
    """With ``wait=True``: each receiver's outcome and the version's timings."""


class Publisher:
    """Publishes versions of named tensors to the sender at ``address``.

    Args:
        address: the sender's ``unix:/path`` or ``host:port``.
        publisher_id: shared by all ranks of one trainer job (default: unique per process).
        rank, world_size: this packer among the ranks that together fill every bucket.

    Raises:
        TransportError: no sender answers at ``address``.
    """

    def __init__(
        self,
        address: str,
        *,
        publisher_id: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.address = address
        self.publisher_id = publisher_id or f"publisher-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.rank, self.world_size = rank, world_size
        self._channel, self._stub = connect(address, connect_timeout_s)
        self._lanes = ClientSettings().lanes  # read once: settings cost ~0.5 ms to read
        self._stream: PublishStream | None = None
        self._stream_closer: weakref.finalize | None = None
        # Caches; each says its key and what invalidates it.
        self._buffers = MappedBuffers()
        """The sender's staging buffers mapped here, by buffer id; kept while this lives."""
        self._exports = Exports(
            f"publisher {self.publisher_id} rank {rank}",
            "it packs every bucket itself and receivers read none of its tensors in place",
        )
        """The last offer's storages exported, and its wire form (see :class:`Exports`)."""
        self._layouts = ParseCache(bucket_from_pb)
        """Bucket layouts by their bytes; cleared when 512 are held."""
        self._published: Published | None = None
        """``publish``'s manifest (checked once) and regions, by its LoRA spec, its part and
        (name, dtype, shape, address, stride) of every tensor, or for the same mapping by its
        tensors' names, identities and addresses; replaced when any changes."""
        self._manifest = WireManifest()
        self._ready_check = ReadyCheck()

    def publish(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        version: int,
        *,
        wait: bool = False,
        timeout_s: float = 600.0,
        lora: LoraAdapterSpec | None = None,
        direct: bool = False,
        part: VersionPartSpec | None = None,
        ready: Mapping[str, torch.cuda.Event] | None = None,
    ) -> PublishResult:
        """Publish ``named_tensors`` as ``version``.

        CUDA tensors are offered to the sender, which then packs them itself when it can map
        them (same host). With ``direct=True`` (every receiver on this host), receivers copy
        contiguous tensors straight out of this process's memory: one copy per byte, no
        staging and no checksum; the call then returns once they have read them.

        It first waits for what the current CUDA stream of each GPU the tensors are on queued
        (the optimizer step that wrote them; order other streams' work before it). Returns once
        every byte is copied out of these tensors (the trainer may change them), or, with
        ``wait=True``, once every receiver applied the version. ``part``: these tensors are
        this sender's share of a version several senders send together.

        ``ready``: the tensors are still being written by GPU work already queued (a
        quantization, the last layers of a step): each name's event, made with
        ``torch.cuda.Event(interprocess=True)`` and recorded once its tensor is written
        (``BlockFp8.ready``). The version then begins without waiting for that work and the
        sender copies each tensor once its event fired, so the first buckets
        cross the link while the rest is written. Name every tensor. Receivers then read
        none in place (``direct`` is off). On the first version of a stream, or where the
        tensors cannot be offered (not on a GPU), the call waits on the host for the events
        and the current streams instead.

        Every version, the tensors' names, dtypes, shapes, addresses and strides are checked
        against the last version's. Passing the same mapping again, holding the same tensor
        objects at the same addresses, skips most of that: a tensor whose shape, dtype or
        strides change in place at the same address (``set_``, ``resize_``, ``.data =`` a view
        of the same memory) must then come in a new mapping.

        Raises:
            ConfigError: ``named_tensors`` is empty (before any call to the sender), or
                ``ready`` misses one of them or holds an event that is not interprocess.
            VersionError: ``version`` is not greater than the last published one.
            ReceiverFailedError: with ``wait=True``, a receiver failed; names each and why.
            SyncTimeoutError: the sender or receivers took longer than ``timeout_s``.
        """
        published = self._published = placed(self._published, named_tensors, lora, part, version)
        tensors, regions = published.tensors, published.regions
        manifest = published.manifest.at(version)
        device = next((t.device for t in tensors.values()), torch.device("cpu"))
        self._ready_check(published, tensors, ready, version)

        def pack(bucket: Bucket, buffer: torch.Tensor) -> None:
            what = f"version {version}, bucket {bucket.index}"
            if published.packs(what, bucket, buffer, tensors):
                return  # copied and checked in one pass (CPU buffers)
            for entry in bucket.entries:
                pack_entry(buffer, entry, tensors[entry.name])
                verify_entry(what, buffer, entry, tensors[entry.name])

        with gc_pause.paused():
            return self._publish(
                manifest, pack, device, wait, timeout_s, regions, direct, published.gpus, ready
            )

    def publish_packed(
        self,
        manifest: VersionManifest,
        pack: PackFn,
        *,
        device: torch.device,
        wait: bool = False,
        timeout_s: float = 600.0,
        regions: Mapping[str, Sequence[Region]] | None = None,
        direct: bool = False,
        ready: Mapping[str, torch.cuda.Event] | None = None,
    ) -> PublishResult:
        """Publish a version whose buckets ``pack`` fills (this rank's part of each bucket).

        Every rank of a multi-rank publisher calls this with the same manifest. ``regions``
        offers where this rank's parts of each tensor live (CUDA memory only; described once
        per mapping object, so pass the same one while the tensors stay put): when the
        ranks' regions cover every staged tensor and the sender can map them, it packs the
        buckets itself and ``pack`` is not called. With ``direct``, receivers on this host
        may read in place the tensors that contiguous regions hold whole, or tile together
        (TP shards of every rank). The sender decides both per version. On CUDA it first
        waits for ``device``'s current stream, or, given ``ready`` (naming every tensor of
        ``regions``), for the events :meth:`publish` says.
        """
        self._ready_check(regions, regions or {}, ready, manifest.version)
        gpus = (device,) if device.type == "cuda" else ()
        with gc_pause.paused():
            return self._publish(
                manifest, pack, device, wait, timeout_s, regions, direct, gpus, ready
            )

    def _publish(
        self,
        manifest: VersionManifest,
        pack: PackFn,
        device: torch.device,
        wait: bool,
        timeout_s: float,
        regions: Mapping[str, Sequence[Region]] | None,
        direct: bool,
        gpus: Iterable[torch.device],
        ready: Mapping[str, torch.cuda.Event] | None = None,
    ) -> PublishResult:
        what = f"publish version {manifest.version} to {self.address}"
        version = manifest.version
        if not manifest.tensors:
            # The sender refuses it too; failing here costs no stream.
            raise ConfigError(
                f"{what}: BeginVersion.manifest of version {version} has no tensors; "
                "publish at least one"
            )
        trace.mark("publish", version=version, rank=self.rank)
        previous = self._stream
        stream = self._stream_for(device)
        # The offer names the events on a stream's first version too (then planned once for
        # every version); they are left to the sender only where its welcome said it waits.
        offer = self._exports.offer(regions, ready) if regions else None
        named = offer is not None and len(offer.ready) > 0
        pending = self._exports.events if named and stream.waits_ready else ()
        whole = (self._manifest(manifest), offer, direct and not named)
        key = stream.key_of(whole)
        begin = pb.BeginVersion(wait_applied=wait, begin_key=key)
        if not stream.begins_sent.alone(key):
            begin.manifest.CopyFrom(whole[0])
            if whole[1] is not None:
                begin.MergeFrom(whole[1])
            begin.allow_direct = whole[2]
        begin.manifest.version = version
        staged: pb.VersionStaged | None = None
        done: pb.VersionStatus | None = None
        start = time.monotonic()
        staged_s, replied, gone = 0.0, False, False
        # The stream lives on across versions, so the deadline is this version's own.
        expired = stream.watchdog.arm(timeout_s)
        try:
            # The sender and receivers read the offered memory: what the trainer queued on its
            # GPUs (its optimizer step, a quantization) must be done first, or be waited for
            # by the sender's copies (ready events).
            if not pending:
                events = named_events((ready or {}).items())
                wait_for_streams(gpus, timeout_s, f"{what} (nothing was sent)", events)
            stream.send_begin(begin)
            for reply in stream.replies:
                replied, kind = True, reply.WhichOneof("kind")
                trace.mark(f"publisher.{kind}", version=version)
                if kind == "welcome":
                    stream.welcome(reply.welcome)
                elif kind == "pack" and reply.pack.version == version:
                    self._pack_one(reply.pack, pack, stream, device, pending)
                elif kind == "staged" and reply.staged.version == version:
                    staged, staged_s = reply.staged, time.monotonic() - start
                    if not wait:
                        break
                elif kind == "done" and reply.done.version == version:
                    done = reply.done
                    break
                # Anything else is a late reply of an earlier version (another rank waited).
        except grpc.RpcError as e:
            self._drop_stream()
            if expired.is_set():
                raise SyncTimeoutError(
                    f"{what}: the version was not {'applied' if wait else 'staged'} within "
                    f"{timeout_s:.0f} s"
                ) from None
            # An earlier version's stream whose sender went away before this end saw it (a
            # restart): nothing reached a sender, so the version goes on a new stream, once.
            gone = stream is previous and not replied and e.code() == grpc.StatusCode.UNAVAILABLE
            if not gone:
                raise error_from_rpc(e, what) from None
        except BaseException as e:
            stream.send(pb.PublisherMessage(error=error_to_pb(e)))
            self._drop_stream()
            raise
        finally:
            stream.watchdog.disarm()
        if gone:
            left = timeout_s - (time.monotonic() - start)
            return self._publish(manifest, pack, device, wait, left, regions, direct, gpus, ready)
        if done is not None and staged is None:
            # ``staged_in_done``: the sender sends ``done`` alone to a rank that waits for it.
            staged, staged_s = pb.VersionStaged(receivers=len(done.receivers)), done.staged_s
        if staged is None or (wait and done is None):
            self._drop_stream()
            raise WeightSyncError(f"{what}: the sender closed the stream early")
        if done is not None:
            _raise_for_failures(done)
        return PublishResult(manifest.version, staged_s, staged.receivers, done)

    def _stream_for(self, device: torch.device) -> PublishStream:
        """The open Publish stream (one per publisher rank, kept across versions), opened
        again for another device, after a failure, or once it ended between versions (its
        sender restarted: the channel reaches the new one, the old stream never will)."""
        if self._stream is not None and (self._stream.device != device or self._stream.call.done()):
            self._drop_stream()
        if self._stream is None:
            hello = pb.PublisherHello(
                publisher_id=self.publisher_id,
                rank=self.rank,
                world_size=self.world_size,
                device=str(device),
                device_uuid=device_uuid(device),
                lanes=self._lanes,
                staged_in_done=True,
            )
            self._stream = PublishStream(self._stub, hello, device)
            # A stream still open when the publisher is dropped, or at interpreter exit, can
            # abort the process in gRPC's teardown ("terminate called without an active
            # exception"): close it then, whoever forgot to.
            self._stream_closer = weakref.finalize(self, self._stream.close)
        return self._stream

    def _drop_stream(self) -> None:
        if self._stream_closer is not None:
            self._stream_closer()  # closes the stream, once
        self._stream = self._stream_closer = None

    def _pack_one(
        self,
        msg: pb.PackBucket,
        pack: PackFn,
        stream: PublishStream,
        device: torch.device,
        pending: Sequence[torch.cuda.Event],
    ) -> None:
        buffer = self._buffers.get(msg.buffer)
        for event in pending:
            torch.cuda.current_stream(device).wait_event(event)
        pack(self._layouts(msg.layout), buffer)
        # The sender checksums and receivers read right after `packed`: copies must be done.
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        if buffer.is_cuda and buffer.device != device:
            torch.cuda.current_stream(buffer.device).synchronize()
        trace.mark("publisher.packed", index=msg.layout.index)
        stream.send(
            pb.PublisherMessage(packed=pb.BucketPacked(version=msg.version, index=msg.layout.index))
        )

    def wait_applied(self, version: int, timeout_s: float = 600.0) -> pb.VersionStatus:
        """Block until every receiver addressed by ``version`` applied it (or failed); a
        version not published yet is waited for first. ``timeout_s = 0``: no limit.

        Raises:
            ReceiverFailedError: naming each receiver that failed and why.
            SyncTimeoutError: not published, or not done, within ``timeout_s``.
            VersionError: a version that will never come (not greater than the last one
                published yet never published, or older than the sender's history).
        """
        try:
            reply = self._stub.WaitApplied(
                pb.WaitAppliedRequest(version=version, timeout_s=timeout_s),
                timeout=timeout_s + 5 if timeout_s > 0 else None,
            )
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"wait for version {version} at {self.address}") from None
        _raise_for_failures(reply.version)
        return reply.version

    def status(self) -> pb.StatusReply:
        """The sender's ``Status``: receivers, publishers, recent versions.

        Raises:
            ConfigError: the sender refused this client's token or certificate.
            TransportError: the sender went away.
        """
        try:
            return self._stub.Status(pb.StatusRequest(), timeout=10)
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"status of the sender at {self.address}") from None

    def close(self) -> None:
        self._drop_stream()
        self._channel.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _raise_for_failures(status: pb.VersionStatus) -> None:
    failed = [o for o in status.receivers if o.state != OutcomeState.APPLIED]
    if failed:
        lines = "; ".join(f"{o.receiver_id}: {describe(o.error)}" for o in failed)
        raise ReceiverFailedError(
            f"version {status.version} failed on {len(failed)} receiver(s): {lines}"
        )
