"""The staged pipeline over shm: buffers reused only after every receiver acked, buckets in
order, and the direct/staged decision per tensor."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch
from weightsync.receiver import TorchReceiver
from weightsync.receiver.torch_receiver import TorchModuleTarget
from weightsync.sender import Publisher
from weightsync.sender.daemon import Sender

from tests.support import TinyNet, digests, step


class SlowTarget(TorchModuleTarget):
    """Loads each bucket late: if the sender reused its buffer early, it would copy the
    next bucket's bytes and the weights would come out wrong."""

    def __init__(self, module, delay_s: float) -> None:
        super().__init__(module)
        self.delay_s = delay_s
        self.order: list[str] = []

    def load(self, tensors):
        time.sleep(self.delay_s)
        self.order.extend(name for name, _ in tensors)
        super().load(tensors)


def test_a_buffer_is_reused_only_after_every_receiver_acked_it(sock_dir):
    from weightsync.receiver.core import ReceiverCore

    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024, num_buffers=2) as sender:
        fast_model, slow_model = TinyNet(seed=1), TinyNet(seed=2)
        fast = TorchReceiver(fast_model, sender.address, receiver_id="fast")
        slow_target = SlowTarget(slow_model, delay_s=0.05)
        slow = ReceiverCore(slow_target, sender.address, receiver_id="slow")
        trainer = TinyNet(seed=3)
        publisher = Publisher(sender.address)
        for version in (1, 2):
            step(trainer, version)
            threads = [
                threading.Thread(target=r.sync, kwargs={"timeout": 60}) for r in (fast, slow)
            ]
            for t in threads:
                t.start()
            result = publisher.publish(trainer.state_dict(), version, wait=True, timeout_s=60)
            for t in threads:
                t.join(60)
            assert result.status.num_buckets > 2 * sender.settings.num_buffers
            assert digests(fast_model) == digests(trainer) == digests(slow_model)
        # Complete tensors reach the target in manifest order (chunked ones are written in
        # place as their chunks come and are not listed here).
        whole = [n for n in trainer.state_dict() if n != "embed"]
        assert slow_target.order[: len(whole)] == whole


def test_direct_needs_cuda_ipc_and_every_receiver_mapping(sock_dir):
    """On CPU staging nothing is direct: every tensor is staged (direct reads need CUDA IPC)."""
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=4096) as sender:
        model = TinyNet(seed=1)
        receiver = TorchReceiver(model, sender.address)
        t = threading.Thread(target=receiver.sync, kwargs={"timeout": 60})
        t.start()
        trainer = TinyNet(seed=2)
        result = Publisher(sender.address).publish(
            trainer.state_dict(), 1, wait=True, timeout_s=60, direct=True
        )
        t.join(60)
        assert result.status.direct_bytes == 0
        assert result.status.staged_bytes == result.status.total_bytes
        assert digests(model) == digests(trainer)


@contextmanager
def _coordinator_with_offer(pieces_of):
    """A coordinator, a 4-tensor manifest and one rank offering ``pieces_of(flat)`` regions
    of a real shm buffer (mapped in this process as the sender maps trainer memory); both
    closed and released on exit."""
    from weightsync.sender.coordinator import Coordinator
    from weightsync.sender.runs import RankConn

    from weightsync.buckets import TensorSpec
    from weightsync.config import SenderSettings
    from weightsync.manifest import VersionManifest
    from weightsync.metrics import SenderMetrics
    from weightsync.transports import get_transport
    from weightsync.v1 import weightsync_pb2 as pb
    from weightsync.wire import regions_to_pb

    co = Coordinator(SenderSettings(bucket_size_bytes=1024), SenderMetrics())
    storage = get_transport("shm").allocate(4096, torch.device("cpu"))
    flat = storage.tensor.view(torch.float32)
    regions = pieces_of(flat)
    begin = pb.BeginVersion(sources=[storage.handle], allow_direct=True)
    begin.pieces.extend(
        regions_to_pb(regions, lambda t: (0, t.storage_offset() * t.element_size()))
    )
    specs = tuple(TensorSpec(f"w{i}", "float32", (64,)) for i in range(4))
    manifest = VersionManifest(1, specs)
    try:
        yield co, manifest, {0: RankConn(0, "cpu", begin)}, flat
    finally:
        co.close()
        get_transport("shm").release(storage)


def test_plan_splits_direct_and_staged_tensors():
    """Whole contiguous pieces go direct only when every receiver maps CUDA IPC; the rest is
    staged, and the sender packs it only if the offer covers every staged byte."""
    from weightsync.sender.runs import ReceiverConn

    from weightsync.regions import Region

    def offer(flat):  # w1, w3 whole; w0 in two pieces; w2 not offered
        return {
            "w1": [Region((0,), flat[0:64])],
            "w3": [Region((0,), flat[64:128])],
            "w0": [Region((0,), flat[128:160]), Region((32,), flat[200:232])],
        }

    with _coordinator_with_offer(offer) as (co, manifest, ranks, _):
        key = b"m"
        co._receivers["local"] = ReceiverConn("local", "torch", 0, "cuda:0", ())
        run = co._plan_run(manifest, key, "p", "cuda_ipc", ranks)
        assert [e.name for e in run.direct.entries] == ["w1", "w3"]
        assert [e.offset for e in run.direct.entries] == [0, 256]
        assert [e.name for b in run.plan.buckets for e in b.entries] == ["w0", "w2"]
        assert run.regions is None  # w2 was not offered: the publisher packs
        co._receivers["far"] = ReceiverConn("far", "torch", 0, "cuda:0", (), data_path="broadcast")
        run = co._plan_run(manifest, key, "p", "cuda_ipc", ranks)
        assert run.direct is None
        assert [e.name for b in run.plan.buckets for e in b.entries] == ["w0", "w1", "w2", "w3"]
        del co._receivers["far"]
        assert co._plan_run(manifest, key, "p", "shm", ranks).direct is None


def test_the_sender_packs_itself_when_the_offer_covers_every_staged_tensor():
    """Every tensor offered (one in two pieces): the sender maps the regions and its packing
    writes exactly the offered bytes."""
    from weightsync.sender.runs import ReceiverConn

    from weightsync.regions import Region, pack_regions

    def offer(flat):
        regions = {f"w{i}": [Region((0,), flat[64 * i : 64 * i + 64])] for i in (1, 2, 3)}
        regions["w0"] = [Region((0,), flat[256:288]), Region((32,), flat[320:352])]
        return regions

    with _coordinator_with_offer(offer) as (co, manifest, ranks, flat):
        flat.copy_(torch.arange(flat.numel(), dtype=torch.float32))
        co._receivers["far"] = ReceiverConn("far", "torch", 0, "cuda:0", (), data_path="broadcast")
        run = co._plan_run(manifest, b"m", "p", "cuda_ipc", ranks)
        assert run.direct is None and run.regions is not None
        assert run.to_pb().sender_packed
        want = {f"w{i}": flat[64 * i : 64 * i + 64] for i in (1, 2, 3)}
        want["w0"] = torch.cat([flat[256:288], flat[320:352]])
        for bucket in run.plan.buckets:
            buffer = torch.zeros(1024, dtype=torch.uint8)
            for entry in bucket.entries:
                pack_regions(buffer, entry, run.regions[entry.name])
                got = buffer[entry.offset : entry.offset + entry.nbytes].view(torch.float32)
                assert torch.equal(got, want[entry.name])


def test_the_sender_packs_offered_shared_memory_itself_and_the_publisher_never_packs(
    sock_dir, monkeypatch
):
    """A trainer whose tensors live in a shm buffer it allocated offers them: the sender maps
    them and packs every bucket (chunked ones too) without a round trip to the publisher,
    twice (the second time from the copies it worked out the first time), bit-exact."""
    import weightsync.sender.publisher as publisher_module

    from weightsync.transports import get_transport

    def never(*args):
        raise AssertionError("the publisher was asked to pack")

    monkeypatch.setattr(publisher_module, "pack_entry", never)
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=1024) as sender:
        store = get_transport("shm").allocate(1 << 16, torch.device("cpu"))
        try:
            reference = TinyNet(seed=3).state_dict()
            tensors, offset = {}, 0
            for name, t in reference.items():
                nbytes = t.numel() * t.element_size()
                view = store.tensor[offset : offset + nbytes].view(t.dtype).view(t.shape)
                tensors[name] = view.copy_(t)
                offset += (nbytes + 255) // 256 * 256
            model = TinyNet(seed=1)
            receiver = TorchReceiver(model, sender.address)
            publisher = Publisher(sender.address)
            for version in (1, 2):
                t = threading.Thread(target=receiver.sync, kwargs={"timeout": 60})
                t.start()
                result = publisher.publish(tensors, version, wait=True, timeout_s=60)
                t.join(60)
                assert result.status.sender_packed
                assert result.status.num_buckets > 2
                live = model.state_dict()
                assert all(torch.equal(live[n], tensors[n]) for n in tensors), version
                for v in tensors.values():  # a stand-in optimizer step, in place
                    v.add_(1)
        finally:
            get_transport("shm").release(store)


def test_packing_does_not_wait_for_the_reads_of_a_failed_receiver():
    """A receiver acked (its read event is queued for the slot's next packing), then failed:
    its event is dropped (a dead process's event might never complete); others' stay."""
    from weightsync.sender.runs import Outcome, ReadEvent, ReceiverConn, Slot

    from weightsync.errors import ProtocolError
    from weightsync.transports import get_transport

    with _coordinator_with_offer(lambda flat: {}) as (co, manifest, ranks, _):
        for rid in ("a", "b"):
            co._receivers[rid] = ReceiverConn(rid, "torch", 0, "cuda:0", ())
        run = co._plan_run(manifest, b"m", "p", "shm", ranks)
        run.outcomes = {"a": Outcome(), "b": Outcome()}
        buffer = get_transport("shm").allocate(256, torch.device("cpu"))
        slot = Slot(buffer, "cpu", after=[ReadEvent("a", "event-a"), ReadEvent("b", "event-b")])
        co._slots = [slot]
        with co._cond:
            co._fail(run, "a", ProtocolError("receiver a closed its stream"), notify=False)
        assert slot.after == [ReadEvent("b", "event-b")]
        assert run.outcomes["a"].state == "failed" and run.outcomes["b"].state == "pending"
