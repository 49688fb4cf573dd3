"""Issue 16 items 3 and 4: every field a peer sends is bounded and checked where it enters.

Each bad message is answered with the exact gRPC status and details naming the field, and
leaves nothing behind: no thread, no joined rank, no version number taken, no receiver that
would cost an ack timeout; Status still answers at once and the next good version applies.
Before, an overflowing shape made the sender allocate without bound under its lock, version
2^64-1 blocked every later publish, a 100 MB name made Status too large, and a deep LoRA JSON,
a negative stride, an empty or second receiver hello left a traceback and a hanging stream.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from tests.support import TinyNet, digests, sync_in_thread
from tests.support.raw_streams import (
    MemoryConnection,
    RawStream,
    assert_no_threads_left,
    assert_nothing_joining,
    begin,
    raw_publisher,
    raw_receiver,
    status_within,
    stream_threads,
)
from tests.support.waiting import wait_until
from weightsync import limits
from weightsync.control.client import connect
from weightsync.errors import ConfigError, PlanError, ReplacedError
from weightsync.manifest import LoraAdapterSpec
from weightsync.receiver import ReceiverCore, TorchReceiver
from weightsync.receiver.torch_receiver import TorchModuleTarget
from weightsync.sender import Publisher
from weightsync.v1 import weightsync_pb2 as pb

INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
BIG = 2**62
SHM = pb.BufferHandle(buffer_id="b", nbytes=64, shm=pb.ShmHandle(path="/dev/shm/not-there"))


def spec(name="w", dtype="float32", shape=(4,)) -> pb.TensorSpec:
    return pb.TensorSpec(name=name, dtype=dtype, shape=list(shape))


def piece(**fields) -> pb.SourcePiece:
    base = {"name": "w", "source": 0, "dtype": "float32", "size": [4], "stride": [1]}
    return pb.SourcePiece(**(base | {"dst_start": [0]} | fields))


def lora(config_json: str) -> pb.Manifest:
    adapter = pb.LoraAdapter(name="a", config_json=config_json, tensor_names=[])
    return pb.Manifest(version=2, tensors=[spec()], lora=adapter)


# (begin message, status code, details) for version 2 after a good version 1.
REFUSED_BEGINS = {
    "shape overflows": (
        begin(2, [spec(shape=(BIG, BIG))]),
        INVALID,
        f"ConfigError: Manifest.tensors[0] 'w' of shape [{BIG}, {BIG}] float32 is "
        f"{BIG * BIG * 4} bytes, over the limit of {limits.MAX_TENSOR_BYTES}",
    ),
    "too many bucket entries at the sender's bucket size": (
        begin(2, [spec(shape=(2**31,))]),  # 8 GiB in 4096-byte buckets
        INVALID,
        "ConfigError: BeginVersion.manifest would plan into about 2097153 bucket entries at "
        "4096-byte buckets, over the limit of 1048576; publish fewer or smaller tensors, or "
        "run the sender with a larger bucket_size_bytes",
    ),
    "negative dimension": (
        begin(2, [spec(shape=(-1, 4))]),
        INVALID,
        "ConfigError: Manifest.tensors[0].shape of 'w' [-1, 4] has a negative entry",
    ),
    "too many dimensions": (
        begin(2, [spec(shape=(1,) * 17)]),
        INVALID,
        "ConfigError: Manifest.tensors[0].shape of 'w' has 17 dimensions, over the limit of 16",
    ),
    "version 2^64-1 (-1 on the wire)": (
        begin(2**64 - 1),
        INVALID,
        "PlanError: Manifest.version 18446744073709551615 is out of range; "
        f"versions are 1..{limits.MAX_VERSION}",
    ),
    "version 2^63": (
        begin(2**63),
        INVALID,
        f"PlanError: Manifest.version {2**63} is out of range; "
        f"versions are 1..{limits.MAX_VERSION}",
    ),
    "tensor name over 1024 bytes": (
        begin(2, [spec(name="n" * 5000)]),
        INVALID,
        "ConfigError: Manifest.tensors[0].name is 5000 bytes, over the limit of 1024: "
        f"{'n' * 64!r}... (5000 characters)",
    ),
    "LoRA config nested 200k deep": (
        begin(2, manifest=lora("[" * 200_000 + "]" * 200_000)),
        INVALID,
        "ConfigError: Manifest.lora.config_json is 400000 bytes, over the limit of 65536: "
        f"{'[' * 64!r}... (400000 characters)",
    ),
    "LoRA config nested 100 deep": (
        begin(2, manifest=lora('{"a": ' * 100 + '"[[[["' + "}" * 100)),
        INVALID,
        "ConfigError: Manifest.lora.config_json nests 100 deep, over the limit of 32",
    ),
    "negative stride": (
        begin(2, sources=[SHM], pieces=[piece(stride=[-1])]),
        INVALID,
        "ConfigError: BeginVersion.pieces[0] (of 'w').stride [-1] has a negative entry",
    ),
    "stride and size of different ranks": (
        begin(2, sources=[SHM], pieces=[piece(stride=[1, 1])]),
        INVALID,
        "ConfigError: BeginVersion.pieces[0] (of 'w'): size [4], stride [1, 1] and dst_start "
        "[0] must have one entry per dimension each",
    ),
    "piece naming a missing source": (
        begin(2, sources=[SHM], pieces=[piece(source=1)]),
        INVALID,
        "ConfigError: BeginVersion.pieces[0] (of 'w').source 1 names no storage: "
        "BeginVersion.sources has 1",
    ),
    "piece naming a missing ready event": (
        begin(2, sources=[SHM], pieces=[piece(ready=2)], ready=[b"e" * 64]),
        INVALID,
        "ConfigError: BeginVersion.pieces[0] (of 'w').ready 2 names no event: "
        "BeginVersion.ready has 1 (0: the piece is written already)",
    ),
    "ready event handle over 4096 bytes": (
        begin(2, sources=[SHM], pieces=[piece(ready=1)], ready=[b"e" * 5000]),
        INVALID,
        "ConfigError: BeginVersion.ready[0] is 5000 bytes, over the limit of 4096",
    ),
    "piece spanning past the byte limit": (
        begin(2, sources=[SHM], pieces=[piece(size=[2], stride=[BIG])]),
        INVALID,
        f"ConfigError: BeginVersion.pieces[0] (of 'w'): size [2] with stride [{BIG}] spans "
        f"over {limits.MAX_TENSOR_BYTES} bytes",
    ),
    "begin key over 64 bytes": (
        begin(2, begin_key=b"k" * 65),
        INVALID,
        "ConfigError: BeginVersion.begin_key is 65 bytes, over the limit of 64",
    ),
    "shm path over 4096 bytes": (
        begin(
            2,
            sources=[pb.BufferHandle(buffer_id="b", shm=pb.ShmHandle(path="/" * 5000))],
            pieces=[piece()],
        ),
        INVALID,
        "ConfigError: BeginVersion.sources[0].shm.path is 5000 bytes, over the limit of 4096: "
        f"{'/' * 64!r}... (5000 characters)",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_BEGINS))
def test_a_begin_past_a_bound_is_refused_naming_the_field(sender, case):
    message, code, details = REFUSED_BEGINS[case]
    Publisher(sender.address).publish({"w": torch.ones(4)}, 1)
    threads = stream_threads()
    raw = raw_publisher(sender.address)
    raw.send(message)
    assert raw.outcome() == (["welcome"], code, details)
    raw.close()
    reply = status_within(sender.address)
    assert [v.version for v in reply.versions] == [1]
    assert sender.coordinator.last_version == 1
    assert_nothing_joining(sender)
    assert_no_threads_left(threads)
    Publisher(sender.address).publish({"w": torch.ones(4)}, 2)  # version 2 was not taken
    assert sender.coordinator.last_version == 2


@pytest.mark.parametrize(
    ("hello", "details"),
    [
        (
            {"publisher_id": "p" * 300},
            "ConfigError: PublisherHello.publisher_id is 300 bytes, over the limit of 256: "
            f"{'p' * 64!r}... (300 characters)",
        ),
        (
            {"world_size": 2**20},
            "ConfigError: PublisherHello.world_size 1048576 is over the limit of 65536",
        ),
        (
            {"device": "cuda:" + "9" * 300},
            "ConfigError: PublisherHello.device is 305 bytes, over the limit of 256: "
            f"{('cuda:' + '9' * 300)[:64]!r}... (305 characters)",
        ),
    ],
)
def test_a_publisher_hello_past_a_bound_is_refused(sender, hello, details):
    raw = raw_publisher(sender.address, **hello)
    raw.send(begin(1))
    assert raw.outcome() == ([], INVALID, details)
    raw.close()
    assert status_within(sender.address).publishers == []


@pytest.mark.parametrize(
    ("message", "code", "details"),
    [
        (
            pb.PublisherMessage(),
            INVALID,
            "ConfigError: PublisherMessage has no kind set; after hello send begin, packed or "
            "error",
        ),
        (
            pb.PublisherMessage(hello=pb.PublisherHello(publisher_id="raw", device="cpu")),
            PRECONDITION,
            "ProtocolError: PublisherMessage.hello: a second hello on one Publish stream; open "
            "a new stream to say hello again",
        ),
    ],
)
def test_a_publisher_message_with_no_kind_or_a_second_hello_is_refused(
    sender, message, code, details
):
    raw = raw_publisher(sender.address)
    raw.send(message)
    assert raw.outcome() == (["welcome"], code, details)
    raw.close()
    assert status_within(sender.address).publishers == []


@pytest.mark.parametrize("lanes", [False, True], ids=["grpc", "lane"])
def test_two_begins_on_one_stream_refuse_the_second_and_abandon_the_first(sender, lanes):
    """The raw publisher never packs version 1; before, its second begin left version 1
    waiting for packing until pack_timeout_s (600 s), blocking every other publisher. On a
    lane (its first begin by gRPC, its second by the lane) the error reaches it the same."""
    threads = stream_threads()
    raw = raw_publisher(sender.address, lanes=lanes)
    raw.send(begin(1, [spec(shape=(4096,))]))  # four buckets: the sender asks it to pack
    assert raw.first() == "welcome"
    assert next(raw.replies).WhichOneof("kind") == "pack"
    raw.send(begin(2))
    kinds, code, details = raw.outcome()
    assert (code, details) == (
        PRECONDITION,
        "ProtocolError: BeginVersion of version 2 arrived on publisher rank 0's stream while "
        "its version 1 is still packing; send the next begin after `staged` (version "
        "abandoned)",
    )
    raw.close()
    (v1,) = status_within(sender.address).versions
    assert (v1.version, v1.state) == (1, "failed")
    assert v1.abandoned.message == details.removeprefix("ProtocolError: ")
    assert_no_threads_left(threads)
    # Nothing of version 1 holds version 2 (the stall timeout, 60 s, would fail this wait).
    Publisher(sender.address).publish({"w": torch.ones(4)}, 2, timeout_s=30)
    (_, v2) = status_within(sender.address).versions
    assert (v2.version, v2.state) == (2, "complete")


def test_a_begin_by_a_key_its_stream_never_sent_is_refused(sender):
    raw = raw_publisher(sender.address)
    begin = pb.BeginVersion(manifest=pb.Manifest(version=1), begin_key=b"k")
    raw.send(pb.PublisherMessage(begin=begin))
    assert raw.outcome() == (
        ["welcome"],
        PRECONDITION,
        "ProtocolError: BeginVersion of version 1 came by begin_key 6b alone, but this stream "
        "holds nothing under that key (never sent with its contents on this stream, or they "
        "were refused); send the contents with the key",
    )
    raw.close()
    assert_nothing_joining(sender)


def test_a_packed_index_past_the_versions_buckets_is_refused(sender):
    raw = raw_publisher(sender.address)
    raw.send(begin(1))
    assert raw.first() == "welcome"
    assert next(raw.replies).WhichOneof("kind") == "pack"
    raw.send(pb.PublisherMessage(packed=pb.BucketPacked(version=1, index=7)))
    assert raw.outcome() == (
        [],
        INVALID,
        "ConfigError: BucketPacked.index 7 is not a staged bucket of version 1, which has 1",
    )
    raw.close()
    (v1,) = status_within(sender.address).versions
    assert v1.state == "failed"


def test_wait_applied_out_of_range_is_invalid_argument(sender):
    channel, stub = connect(sender.address, 10)
    with channel:
        for request, details in (
            (
                pb.WaitAppliedRequest(version=2**64 - 1),
                "ConfigError: WaitAppliedRequest.version 18446744073709551615 is out of range; "
                f"versions are 1..{limits.MAX_VERSION}",
            ),
            (
                pb.WaitAppliedRequest(version=1, timeout_s=-1),
                "ConfigError: WaitAppliedRequest.timeout_s -1.0 must be >= 0 (0: until the "
                "call's deadline)",
            ),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                stub.WaitApplied(request, timeout=5)
            assert (refused.value.code(), refused.value.details()) == (INVALID, details)


@pytest.mark.parametrize(
    ("hello", "details"),
    [
        (
            {"receiver_id": "r" * 300},
            "ConfigError: ReceiverHello.receiver_id is 300 bytes, over the limit of 256: "
            f"{'r' * 64!r}... (300 characters)",
        ),
        (
            {"host_id": "h" * 300},
            "ConfigError: ReceiverHello.host_id is 300 bytes, over the limit of 256: "
            f"{'h' * 64!r}... (300 characters)",
        ),
        (
            {"transports": ["shm"] * 17},
            "ConfigError: ReceiverHello.transports has 17 entries, over the limit of 16",
        ),
    ],
)
def test_a_receiver_hello_past_a_bound_is_refused(sender, hello, details):
    raw = raw_receiver(sender.address, **hello)
    assert raw.outcome() == ([], INVALID, details)
    raw.close()
    assert status_within(sender.address).receivers == []


@pytest.mark.parametrize(
    ("message", "code", "details"),
    [
        (
            pb.ReceiverMessage(),
            INVALID,
            "ConfigError: ReceiverMessage has no kind set; after hello send verdict, ack, "
            "applied, exported or offer",
        ),
        (
            pb.ReceiverMessage(hello=pb.ReceiverHello(receiver_id="again")),
            PRECONDITION,
            "ProtocolError: ReceiverMessage.hello: a second hello on one Receive stream; open "
            "a new stream to register again",
        ),
        (
            pb.ReceiverMessage(ack=pb.BucketAck(version=1, read_event=b"x" * 5000)),
            INVALID,
            "ConfigError: BucketAck.read_event is 5000 bytes, over the limit of 4096",
        ),
        (
            pb.ReceiverMessage(
                applied=pb.VersionApplied(version=1, ok=True, acks=[pb.BucketAck(version=1)] * 65)
            ),
            INVALID,
            "ConfigError: VersionApplied.acks has 65 entries, over the limit of 64",
        ),
        (
            pb.ReceiverMessage(
                applied=pb.VersionApplied(
                    version=1, ok=True, acks=[pb.BucketAck(version=2, index=3, ok=True)]
                )
            ),
            PRECONDITION,
            "ProtocolError: VersionApplied.acks[0] (bucket 3 of version 2, ok True) came with "
            "applied ok True for version 1; send with a commit only its own version's acks of "
            "buckets read whole, and any other ack alone, before it",
        ),
    ],
)
@pytest.mark.parametrize("lanes", [False, True], ids=["grpc", "lane"])
def test_a_bad_receiver_message_closes_its_stream_and_costs_no_ack_timeout(
    sender, message, code, details, lanes
):
    """The broken receiver is out at once: the next version is not addressed to it, so it
    completes without waiting out the sender's 20 s ack timeout. A message that came by its
    lane is answered the same (the error ends the gRPC stream, which closes the lane)."""
    threads = stream_threads()
    raw = raw_receiver(sender.address, lanes=lanes)
    assert raw.first() == "welcome"
    raw.send(message)
    assert raw.outcome() == ([], code, details)
    raw.close()
    (status,) = status_within(sender.address).receivers
    assert (status.receiver_id, status.connected) == ("raw", False)
    assert_no_threads_left(threads)
    model, trainer = TinyNet(seed=1), TinyNet(seed=2)
    receiver = TorchReceiver(model, sender.address, receiver_id="good")
    syncs, _ = sync_in_thread(receiver)
    result = Publisher(sender.address).publish(trainer.state_dict(), 1, wait=True, timeout_s=15)
    assert [o.receiver_id for o in result.status.receivers] == ["good"]
    assert syncs.finish(10) == [1] and digests(model) == digests(trainer)
    receiver.close()


def test_a_receivers_long_error_text_is_shortened_in_status(sender):
    raw = raw_receiver(sender.address)
    assert raw.first() == "welcome"
    publisher = Publisher(sender.address)
    publisher.publish({"w": torch.ones(4)}, 1)  # one bucket: staged without the raw's ack
    assert next(raw.replies).WhichOneof("kind") == "start"
    error = pb.ErrorDetail(code="X" * 5000, message="m" * 1_000_000, tensor="t" * 5000)
    raw.send(pb.ReceiverMessage(verdict=pb.ManifestVerdict(version=1, error=error)))

    def failed() -> bool:  # the verdict is handled on the raw stream's own thread
        return status_within(sender.address).versions[-1].receivers[0].state == "failed"

    wait_until(failed, 10, "the refusing verdict to fail the raw receiver")
    reply = status_within(sender.address)
    (outcome,) = reply.versions[-1].receivers
    for text in (outcome.error.code, outcome.error.message, outcome.error.tensor):
        assert len(text.encode()) <= limits.MAX_ERROR_BYTES
    assert outcome.error.message.endswith("... (1000000 bytes, shortened)")
    (status,) = reply.receivers
    assert len(status.last_error.encode()) <= limits.MAX_ERROR_BYTES
    raw.close()
    publisher.close()


@pytest.mark.parametrize(
    ("box", "why"),
    [
        (pb.TensorBox(name="w", start=[2], size=[3]), "shape [4]"),
        (pb.TensorBox(name="w", start=[0, 0], size=[1, 1]), "shape [4]"),
        (pb.TensorBox(name="nope", start=[0], size=[1]), "not in the version"),
    ],
)
def test_a_verdict_declaring_a_box_outside_its_tensor_fails_that_receiver(sender, box, why):
    """An accepting verdict's ``keeps`` must be boxes of the version's tensors: one that is not
    fails the receiver in that version, naming the tensor; the sender plans nothing from it."""
    outcome = _failed_by(sender, pb.ManifestVerdict(version=1, accepted=True, keeps=[box]))
    assert outcome.error.message.startswith(
        f"raw declared it keeps start={list(box.start)} size={list(box.size)} of {box.name!r} "
        f"({why})"
    ), outcome.error.message
    (status,) = status_within(sender.address).receivers
    assert status.kept_bytes == 0


def test_a_keeps_key_the_stream_never_sent_boxes_with_fails_that_receiver(sender):
    """The welcome offers ``keeps_keys``; a verdict naming a key no verdict on the stream listed
    boxes with stands for nothing: it fails that receiver, naming the key and the fix."""
    outcome = _failed_by(sender, pb.ManifestVerdict(version=1, accepted=True, keeps_key=b"k"))
    assert outcome.error.message.startswith(
        "raw's verdict on version 1 came by keeps_key 6b alone, but this stream holds nothing "
        "under that key"
    ), outcome.error.message


def _failed_by(sender, verdict: pb.ManifestVerdict) -> pb.ReceiverOutcome:
    """The outcome of a raw receiver answering version 1 with ``verdict``, which must fail it
    with a ProtocolError and an abort."""
    raw = raw_receiver(sender.address)
    assert next(raw.replies).welcome.keeps_keys
    with Publisher(sender.address) as publisher:
        publisher.publish({"w": torch.ones(4)}, 1)
        assert next(raw.replies).WhichOneof("kind") == "start"
        raw.send(pb.ReceiverMessage(verdict=verdict))
        # The bucket and the end may be on their way already; then the abort.
        kinds = [next(raw.replies).WhichOneof("kind")]
        while kinds[-1] != "abort" and len(kinds) < 4:
            kinds.append(next(raw.replies).WhichOneof("kind"))
        assert kinds[-1] == "abort", kinds
        (outcome,) = status_within(sender.address).versions[-1].receivers
        assert outcome.state == "failed" and outcome.error.code == "ProtocolError"
    raw.close()
    return outcome


def test_a_lora_config_too_deep_is_refused_before_any_rpc():
    with pytest.raises(ConfigError) as refused:
        LoraAdapterSpec("a", "[" * 40 + "]" * 40, ())
    assert str(refused.value) == (
        "LoRA adapter 'a': config_json nests 40 deep, over the limit of 32"
    )
    LoraAdapterSpec("a", '{"target_modules": ["q_proj"], "note": "[[[[[[[[[[[["}', ())


@pytest.mark.parametrize(
    ("manifest", "error", "message"),
    [
        (
            pb.Manifest(version=1, tensors=[spec(shape=(BIG, BIG))]),
            ConfigError,
            f"Manifest.tensors[0] 'w' of shape [{BIG}, {BIG}] float32 is {BIG * BIG * 4} bytes, "
            f"over the limit of {limits.MAX_TENSOR_BYTES}",
        ),
        (
            pb.Manifest(version=2**64 - 1, tensors=[spec()]),
            PlanError,
            f"Manifest.version {2**64 - 1} is out of range; versions are 1..{limits.MAX_VERSION}",
        ),
    ],
)
def test_a_receiver_rejects_an_announced_manifest_past_a_bound_before_any_write(
    manifest, error, message
):
    """What a real sender never announces (it refuses such a begin): the receiver answers a
    rejected verdict naming the field, instead of raising without one (the sender then
    waited out its ack timeout)."""
    model = TinyNet(seed=1)
    before = digests(model)
    connection = MemoryConnection()
    core = ReceiverCore(TorchModuleTarget(model), "memory:", connection=connection)
    connection.announce(pb.Announcement(start=pb.VersionStart(manifest=manifest)))
    with pytest.raises(error) as rejected:
        core.sync(timeout=5)
    assert str(rejected.value) == message
    (sent,) = connection.sent
    assert (sent.verdict.version, sent.verdict.accepted) == (manifest.version, False)
    assert (sent.verdict.error.code, sent.verdict.error.message) == (error.__name__, message)
    assert digests(model) == before


def test_a_status_reply_over_its_budget_leaves_out_the_oldest_versions(sender, monkeypatch):
    publisher = Publisher(sender.address)
    for version in range(1, 9):
        publisher.publish({"w": torch.ones(4)}, version)
    full = status_within(sender.address)
    assert [v.version for v in full.versions] == list(range(1, 9))
    one = full.versions[-1].ByteSize()
    monkeypatch.setattr(limits, "STATUS_REPLY_BUDGET_BYTES", full.ByteSize() - 3 * one)
    trimmed = status_within(sender.address)
    assert trimmed.ByteSize() <= limits.STATUS_REPLY_BUDGET_BYTES
    assert [v.version for v in trimmed.versions] == list(range(9 - len(trimmed.versions), 9))
    assert 0 < len(trimmed.versions) < 8
    publisher.close()


@pytest.mark.parametrize("call", ["Publish", "Receive"])
def test_a_stream_that_never_says_hello_is_closed_and_frees_its_slot(call):
    """Issue 35: mute streams held their thread and stream slot forever, so a few of them
    locked out every receiver and the trainer. Now each is closed after hello_timeout_s."""
    from tests.support.processes import unix_sender
    from tests.support.raw_streams import RawStream

    with unix_sender(bucket_size_bytes=4096, max_streams=2, hello_timeout_s=1) as s:
        mute = [RawStream(s.address, call, None, timeout_s=60) for _ in range(2)]
        for stream in mute:
            kinds, code, details = stream.outcome()
            assert (kinds, code) == ([], grpc.StatusCode.DEADLINE_EXCEEDED)
            assert details == (
                "no hello within 1 s of opening the stream (hello_timeout_s, "
                "WEIGHTSYNC_HELLO_TIMEOUT_S); the stream is closed: open a new one and send "
                "the hello first"
            )
            stream.close()
        # Both slots are free again: a receiver and the trainer's publisher get them.
        model, trainer = TinyNet(seed=1), TinyNet(seed=2)
        receiver = TorchReceiver(model, s.address, receiver_id="after")
        syncs, _ = sync_in_thread(receiver)
        Publisher(s.address).publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
        assert syncs.finish(30) == [1] and digests(model) == digests(trainer)
        receiver.close()


REPLACED = (
    "ReplacedError: receiver id 'engine-0' was registered again from another connection (a "
    "restarted engine takes its id back); this stream is closed and does not register again"
)


def test_a_restarted_engine_takes_its_id_back_from_a_hung_stream(sender):
    """Issue 35: while the old process of a restarted engine hung (or a squatter held its id)
    the new one was refused "already connected", and the squatter got its versions."""
    hung = raw_receiver(sender.address, receiver_id="engine-0")
    assert hung.first() == "welcome"
    model, trainer = TinyNet(seed=1), TinyNet(seed=2)
    receiver = TorchReceiver(model, sender.address, receiver_id="engine-0")
    kinds, code, details = hung.outcome()
    assert (kinds, code, details) == ([], grpc.StatusCode.ALREADY_EXISTS, REPLACED)
    hung.close()
    syncs, _ = sync_in_thread(receiver)
    result = Publisher(sender.address).publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
    assert [(o.receiver_id, o.state) for o in result.status.receivers] == [("engine-0", "applied")]
    assert syncs.finish(30) == [1] and digests(model) == digests(trainer)
    receiver.close()


def test_two_live_receivers_of_one_id_do_not_flap(sender):
    """The one taken over is told, for good, and does not take the id back (each would
    otherwise register again and take it from the other, forever)."""
    first_model, second_model, trainer = TinyNet(seed=1), TinyNet(seed=3), TinyNet(seed=2)
    first = TorchReceiver(first_model, sender.address, receiver_id="engine-0")
    second = TorchReceiver(second_model, sender.address, receiver_id="engine-0")
    for _ in range(2):  # every later wait says so at once
        with pytest.raises(ReplacedError) as replaced:
            first.sync(timeout=30)
        assert REPLACED.removeprefix("ReplacedError: ") in str(replaced.value)
    syncs, _ = sync_in_thread(second)
    result = Publisher(sender.address).publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
    assert [(o.receiver_id, o.state) for o in result.status.receivers] == [("engine-0", "applied")]
    assert syncs.finish(30) == [1] and digests(second_model) == digests(trainer)
    assert digests(first_model) != digests(trainer)
    connected = [r.receiver_id for r in status_within(sender.address).receivers if r.connected]
    assert connected == ["engine-0"]
    first.close()
    second.close()


@pytest.mark.parametrize(
    ("call", "first", "code", "details"),
    [
        (
            "Publish",
            pb.PublisherMessage(),
            INVALID,
            "ConfigError: expected a hello message first, got a PublisherMessage with no kind "
            "set; send the hello first",
        ),
        (
            "Receive",
            pb.ReceiverMessage(),
            INVALID,
            "ConfigError: expected a hello message first, got a ReceiverMessage with no kind "
            "set; send the hello first",
        ),
        (
            "Publish",
            begin(1),
            PRECONDITION,
            "ProtocolError: expected a hello message first, got a message of kind 'begin'; "
            "send the hello first",
        ),
        (
            "Receive",
            pb.ReceiverMessage(ack=pb.BucketAck(version=1)),
            PRECONDITION,
            "ProtocolError: expected a hello message first, got a message of kind 'ack'; send "
            "the hello first",
        ),
    ],
)
def test_a_first_message_that_is_no_hello_is_refused_by_name(sender, call, first, code, details):
    """Issue 35 item 1: a first message with no kind was FAILED_PRECONDITION "expected a hello
    message first, got None" (Python's None, no error name): it is INVALID_ARGUMENT like a
    kindless message after the hello, and every refusal names its error."""
    raw = RawStream(sender.address, call, first)
    assert raw.outcome() == ([], code, details)
    raw.close()


def test_a_receiver_hello_naming_an_unknown_transport_ends_the_stream(sender):
    """Issue 35 item 8: ``ReceiverHello.transports`` naming no transport is refused."""
    raw = raw_receiver(sender.address, transports=["shm", "rdma"])
    assert raw.outcome() == (
        [],
        INVALID,
        "ConfigError: ReceiverHello.transports[1] 'rdma' is not a transport; known: shm, "
        "cuda_ipc (or send none: any)",
    )
    raw.close()
    assert status_within(sender.address).receivers == []
