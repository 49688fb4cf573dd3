"""Issue 35 item 6: a path is the wrong credential for shm. The sender maps a publisher's offered
shm memory only from the open descriptor the publisher passes with its begin on its lane
(``SCM_RIGHTS``): holding it proves the publisher could open the file. A path alone (gRPC, or a
lane frame without descriptors) is never opened; that publisher is asked to pack instead.

Before, any ``0600`` file of the sender's user named in ``BeginVersion.sources`` was mapped and
its bytes broadcast: another job's staging, or root's files when the sender ran as root.
"""

from __future__ import annotations

import gc
import logging
import os

import pytest
import torch

from tests.support import sync_in_thread
from tests.support.publishers import offered_copy
from weightsync.control.client import connect
from weightsync.control.lanes import ClientStream
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher
from weightsync.transports import get_transport
from weightsync.transports.shm import SHM_DIR
from weightsync.v1 import weightsync_pb2 as pb

N = 64
"""Elements of the one float32 tensor ``w`` the raw publishers offer."""


class One(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(N))


def _file(path: str, values: torch.Tensor) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(values.numpy().tobytes())


def _begin(version: int, path: str) -> pb.BeginVersion:
    """``w`` offered whole at the start of the shm file ``path``; waits for ``done``."""
    return pb.BeginVersion(
        manifest=pb.Manifest(
            version=version, tensors=[pb.TensorSpec(name="w", dtype="float32", shape=[N])]
        ),
        wait_applied=True,
        sources=[
            pb.BufferHandle(buffer_id=f"b{version}", nbytes=4 * N, shm=pb.ShmHandle(path=path))
        ],
        pieces=[
            pb.SourcePiece(
                name="w", source=0, offset=0, dtype="float32", size=[N], stride=[1], dst_start=[0]
            )
        ],
    )


def _publish_raw(address: str, begin: pb.BeginVersion, fds: list[int], lanes: bool = True):
    """Publish ``begin`` as a client written from the protocol: on a lane (when ``lanes``),
    passing ``fds`` with it. Packs what it is asked to with the values ``begin`` offers, so a
    version goes through either way; returns (the kinds of the sender's replies, ``done``)."""
    channel, stub = connect(address)
    hello = pb.PublisherHello(publisher_id="raw", device="cpu", lanes=lanes)
    stream = ClientStream(stub.Publish, pb.PublisherMessage(hello=hello), pb.SenderReply)
    try:
        welcome = next(stream.replies).welcome
        if lanes:
            stream.take_lane(welcome.lane)
            assert stream.lane is not None
        stream.send(pb.PublisherMessage(begin=begin), *([fds] if fds else []))
        kinds = []
        for reply in stream.replies:
            kind = reply.WhichOneof("kind")
            kinds.append(kind)
            if kind == "pack":
                buffer = get_transport("shm").map(reply.pack.buffer)
                for e in reply.pack.layout.entries:
                    buffer[e.offset : e.offset + e.nbytes] = torch.zeros(N).view(torch.uint8)
                packed = pb.BucketPacked(version=reply.pack.version, index=reply.pack.layout.index)
                stream.send(pb.PublisherMessage(packed=packed))
            elif kind == "done":
                return kinds, reply.done
        raise AssertionError(f"the stream ended after {kinds}")
    finally:
        stream.end()
        stream.cancel()
        channel.close()


@pytest.fixture
def shm_paths():
    made: list[str] = []

    def path(name: str) -> str:
        made.append(f"/dev/shm/weightsync-test-{os.getpid()}-{name}")
        return made[-1]

    yield path
    for p in made:
        if os.path.exists(p):
            os.unlink(p)


@pytest.fixture
def receiver(sender):
    model = One()
    r = TorchReceiver(model, sender.address, receiver_id="r")
    yield model, r
    r.close()


def test_a_path_named_without_its_descriptor_is_never_mapped(sender, receiver, shm_paths, caplog):
    """Another job's staging (a 0600 file of the sender's user the client names but passed
    no descriptor of), named on a lane: the sender asks the client to pack; the receiver gets
    what the client packed, never the file's bytes."""
    model, r = receiver
    victim = shm_paths("victim")
    _file(victim, torch.full((N,), 7.0))
    t, results = sync_in_thread(r)
    with caplog.at_level(logging.WARNING, logger="weightsync.sender"):
        kinds, done = _publish_raw(sender.address, _begin(1, victim), [])
    t.join()
    assert (kinds, done.sender_packed) == (["pack", "staged", "done"], False)
    assert torch.equal(model.w.detach(), torch.zeros(N))  # what it packed, not the victim's
    assert (
        f"the publishers pack: publisher rank 0's offered memory does not map here (shared "
        f"memory {victim}: not mapped, its open descriptor did not come with the begin (the "
        "sender maps offered memory only from the descriptors a publisher passes on its lane, "
        "protocol §6.1))"
    ) in caplog.text


def test_the_descriptor_is_mapped_and_the_path_beside_it_ignored(sender, receiver, shm_paths):
    """The sender reads the file the descriptor is open on: a path naming another file (the
    victim) beside it changes nothing."""
    model, r = receiver
    victim, own = shm_paths("victim"), shm_paths("own")
    _file(victim, torch.full((N,), 7.0))
    _file(own, torch.arange(N, dtype=torch.float32))
    t, results = sync_in_thread(r)
    fd = os.open(own, os.O_RDONLY)  # read-only is enough: the sender maps it read-only
    try:
        kinds, done = _publish_raw(sender.address, _begin(1, victim), [fd])
    finally:
        os.close(fd)
    t.join()
    assert (kinds, done.sender_packed) == (["staged", "done"], True)
    assert torch.equal(model.w.detach(), torch.arange(N, dtype=torch.float32))


def test_a_begin_with_descriptors_not_one_per_shm_source_is_refused(sender, shm_paths):
    own = shm_paths("own")
    _file(own, torch.arange(N, dtype=torch.float32))
    fds = [os.open(own, os.O_RDONLY), os.open(own, os.O_RDONLY)]
    try:
        with pytest.raises(Exception) as e:
            _publish_raw(sender.address, _begin(1, own), fds)
    finally:
        for fd in fds:
            os.close(fd)
    assert e.value.details() == (
        "ProtocolError: BeginVersion of version 1 came with 2 descriptor(s) for its 1 shm "
        "source(s); pass one per shm source, in the order of BeginVersion.sources, or none"
    )


def test_a_descriptor_of_no_regular_file_is_refused_and_the_publisher_packs(
    sender, receiver, caplog
):
    model, r = receiver
    t, results = sync_in_thread(r)
    read_end, write_end = os.pipe()
    try:
        with caplog.at_level(logging.WARNING, logger="weightsync.sender"):
            kinds, done = _publish_raw(sender.address, _begin(1, "/dev/shm/x"), [read_end])
    finally:
        os.close(read_end)
        os.close(write_end)
    t.join()
    assert (kinds, done.sender_packed) == (["pack", "staged", "done"], False)
    assert (
        "publisher rank 0: shared memory /dev/shm/x: refused, its descriptor is not a regular "
        "file; it packs instead"
    ) in caplog.text


@pytest.mark.parametrize("lanes", [True, False])
def test_our_publisher_passes_its_descriptors_on_a_lane_only(sender, monkeypatch, lanes):
    """Same host, lanes on (the default): the sender packs from the publisher's shm memory
    itself, also on the stream's first version; lanes off: it cannot, the publisher packs."""
    monkeypatch.setenv("WEIGHTSYNC_LANES", "1" if lanes else "0")
    model = One()
    r = TorchReceiver(model, sender.address, receiver_id="r")
    store, tensors = offered_copy({"w": torch.zeros(N)})
    t, results = sync_in_thread(r, n=3)
    try:
        with Publisher(sender.address) as publisher:
            for version in (1, 2, 3):  # 2 and 3 send the first begin's key alone
                tensors["w"].fill_(version)
                result = publisher.publish(tensors, version, wait=True, timeout_s=60)
                assert result.status.sender_packed == lanes
        t.join()
        assert torch.equal(model.w.detach(), torch.full((N,), 3.0))
    finally:
        r.close()
        get_transport("shm").release(store)


def _open_fds() -> int:
    """Descriptors of shared memory files open in this process. Only those: the process's
    other descriptors (a stream's socket closing, a library's lazily made eventfd) come and go
    with what other threads do, and once made a count of all of them fail by one (CI)."""
    # Some per-version objects die by the collector, which runs between versions: what it
    # frees is not leaked.
    gc.collect()
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(SHM_DIR + "/")
        except OSError:  # closed while listed (the listing's own descriptor, at least)
            continue
    return n


def test_no_descriptor_is_left_open_across_versions(sock_dir):
    """Begins by key alone, of a new mapping of the same file and of new files every version:
    the sender (in this process) holds as many descriptors after 36 versions as after 12. Each
    mapping holds one (CPython's mmap keeps a duplicate) while a kept version (``history``, 4
    here), a cached offer (4) or its stream's last begin with contents refers to it; so does the
    publisher's own mapping of each file, in this process too."""
    from weightsync.sender.daemon import Sender

    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=4096, history=4) as sender:
        _versions_of_new_files(sender)


VERSIONS = 36
"""Eight new files after version 12, by when the kept versions and cached offers (4 each) are
full: a leak of one descriptor per file shows."""


def _versions_of_new_files(sender) -> None:
    model = One()
    r = TorchReceiver(model, sender.address, receiver_id="r")
    t, results = sync_in_thread(r, n=VERSIONS)
    shm = get_transport("shm")
    store, tensors = offered_copy({"w": torch.zeros(N)})
    counts = {}
    try:
        with Publisher(sender.address) as publisher:
            for version in range(1, VERSIONS + 1):
                if version % 3 == 0:  # a new file: a whole begin with a new descriptor
                    shm.release(store)
                    store, tensors = offered_copy({"w": torch.zeros(N)})
                elif version % 3 == 1:  # a new mapping object: a whole begin, the same file
                    tensors = dict(tensors)
                tensors["w"].fill_(version)
                result = publisher.publish(tensors, version, wait=True, timeout_s=60)
                assert result.status.sender_packed, version
                counts[version] = _open_fds()
        t.join()
        assert torch.equal(model.w.detach(), torch.full((N,), float(VERSIONS)))
        assert counts[VERSIONS] <= counts[12], sorted(counts.items())
    finally:
        r.close()
        shm.release(store)
