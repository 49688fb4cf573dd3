"""A broadcast group is kept only while it can carry the next version, and errors about one
say which group and whose it is."""

from types import SimpleNamespace

from tests.support.sender_parts import published, sender_parts
from weightsync.errors import NameResolutionError, TransportError
from weightsync.sender.broadcast import group_name, in_step
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.wire import error_to_pb


def hello(rid: str) -> pb.ReceiverHello:
    return pb.ReceiverHello(receiver_id=rid, engine="torch", device="cpu", host_id="elsewhere")


def test_a_group_is_named_by_what_it_carries_and_its_receivers():
    run = SimpleNamespace(
        slices=(SimpleNamespace(members=("r0", "r2")), SimpleNamespace(members=("r1", "r3")))
    )
    assert group_name(run, ("r1", "r3")) == "slice group 1 (receivers r1, r3)"
    assert group_name(run, ("r4",)) == "the staged buckets' group (receivers r4)"


def test_a_group_is_kept_while_its_members_streams_are_the_ones_that_joined():
    parts = sender_parts()
    joined = tuple(parts.registry.add_receiver(hello(rid)) for rid in ("r0", "r1"))
    assert in_step(joined, joined)
    # r1 registers again (its sender was stopped past the keepalives, or it restarted): it
    # may have left a transfer half done, so the group is built again.
    with parts.cond:
        parts.registry.disconnect(joined[1])
    again = (joined[0], parts.registry.add_receiver(hello("r1")))
    assert not in_step(joined, again)
    assert not in_step(joined, joined[:1])


def test_a_transport_error_of_a_member_rebuilds_its_group_other_errors_do_not():
    parts = sender_parts()
    joined = tuple(parts.registry.add_receiver(hello(rid)) for rid in ("r0", "r1"))
    run = published(parts, 1)
    for conn, error in zip(
        joined,
        (NameResolutionError("no tensor 'w' in the model"), TransportError("recv timed out")),
        strict=True,
    ):
        failed = pb.VersionApplied(version=run.version, ok=False, error=error_to_pb(error))
        parts.outcomes.on_receiver_message(conn, pb.ReceiverMessage(applied=failed))
    assert [run.outcomes[c.receiver_id].state for c in joined] == ["failed", "failed"]
    # r0 failed in step (it took part in every transfer); r1's receive failed, and gloo
    # closes the pair of a receive that timed out.
    assert in_step(joined[:1], joined[:1])
    assert not in_step(joined, joined)
