"""A broadcast group is kept only while it can carry the next version, and errors about one
say which group and whose it is."""

from types import SimpleNamespace

from tests.support.sender_parts import published, sender_parts
from weightsync.errors import NameResolutionError, TransportError
from weightsync.transports.broadcast import QueuedBroadcast, SenderBroadcast, group_name, in_step
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


class _Group:
    """Stands in for a gloo group: only whether the sender closed it is observed."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _LostPeers:
    """A broadcast whose receivers went away, as gloo reports it once the pair is closed."""

    def __init__(self, group: _Group) -> None:
        self.group = group

    def wait(self) -> None:
        raise TransportError("Connection closed by peer [127.0.0.1]:30603")


def test_a_failed_broadcast_of_an_older_group_leaves_the_rebuilt_group_and_its_version_alone():
    """CI failure of 2026-11-23: a version every receiver failed (its sender was stopped) ends
    with a broadcast still queued on its slot; the next version rebuilds the same receivers'
    group, then finishes that stale broadcast before packing into the slot. Its error must not
    close the new group nor fail the new version."""
    parts = sender_parts()
    for rid in ("r0", "r1"):
        parts.registry.add_receiver(hello(rid))
    members = ("r0", "r1")
    broadcast = SenderBroadcast(
        "127.0.0.1", 5, parts.cond, parts.registry.broadcast_members, parts.registry.receiver
    )
    old, new = published(parts, 1), published(parts, 2)
    old_group, new_group = _Group(), _Group()
    broadcast._groups[members] = new_group
    slot = SimpleNamespace(broadcast=None)
    slot.broadcast = QueuedBroadcast(old, members, _LostPeers(old_group))
    assert broadcast.finish(slot)
    assert slot.broadcast is None
    assert not new_group.closed and broadcast._groups[members] is new_group
    assert [new.outcomes[rid].state for rid in members] == ["pending", "pending"]
    assert [old.outcomes[rid].state for rid in members] == ["failed", "failed"]
    # The current group's own failure closes it and fails its version's receivers.
    slot.broadcast = QueuedBroadcast(new, members, _LostPeers(new_group))
    assert broadcast.finish(slot)
    assert new_group.closed and members not in broadcast._groups
    assert [new.outcomes[rid].state for rid in members] == ["failed", "failed"]
    assert "Connection closed by peer" in new.outcomes["r0"].error.message
