"""``Publisher.publish`` given the same mapping again: it skips the full placement check while
the mapping holds the same tensor objects at the same addresses, and checks again (describing
the tensors anew) as soon as a value, a name or an address changed. Receivers get the bytes of
every version either way."""

from __future__ import annotations

import pytest
import torch

from tests.support import TinyNet, step, sync_in_thread
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher, Sender


def test_a_mapping_published_again_is_checked_again_only_when_its_tensors_moved(
    sock_dir, monkeypatch
):
    import weightsync.sender.placement as placement

    checks = []
    real = placement.layout_key
    monkeypatch.setattr(placement, "layout_key", lambda tensors: checks.append(1) or real(tensors))
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=4096) as sender:
        model, trainer = TinyNet(seed=1), TinyNet(seed=2)
        receiver = TorchReceiver(model, sender.address)
        publisher = Publisher(sender.address)
        mapping = dict(trainer.state_dict())
        proj = mapping["proj"]

        def publish(version: int) -> None:
            t, _ = sync_in_thread(receiver)
            publisher.publish(mapping, version, wait=True, timeout_s=60)
            assert t.finish(60) == [version]
            for name, tensor in model.state_dict().items():
                assert torch.equal(tensor, mapping[name]), (version, name)

        publish(1)
        step(trainer, 2)  # new values in the same memory
        publish(2)
        assert len(checks) == 1  # the same mapping, the same tensors: no second check
        proj.data = torch.randn(16, 16).to(torch.bfloat16)  # the same object, new memory
        publish(3)
        assert len(checks) == 2
        mapping["norm"] = torch.randn(16)  # another tensor under a name
        publish(4)
        assert len(checks) == 3
        publish(5)
        assert len(checks) == 3
        mapping = dict(mapping)  # a new mapping of the same tensors
        publish(6)
        assert len(checks) == 4
        publisher.close()


def test_ready_events_that_miss_a_tensor_are_refused_by_its_name_before_any_call(sock_dir):
    from weightsync.errors import ConfigError

    with Sender(f"unix:{sock_dir}/s.sock") as sender, Publisher(sender.address) as publisher:
        tensors = {"a": torch.ones(4), "b": torch.ones(4)}
        with pytest.raises(ConfigError, match="`ready` names no event for 'b'; name every"):
            publisher.publish(tensors, 1, ready={"a": None})
        assert not publisher.status().versions


def test_publish_packed_refuses_ready_events_that_miss_an_offered_tensor(sock_dir):
    from weightsync.buckets import TensorSpec
    from weightsync.errors import ConfigError
    from weightsync.manifest import VersionManifest
    from weightsync.regions import Region

    with Sender(f"unix:{sock_dir}/s.sock") as sender, Publisher(sender.address) as publisher:
        a, b = torch.ones(4), torch.ones(4)
        manifest = VersionManifest(1, (TensorSpec.of("a", a), TensorSpec.of("b", b)))
        regions = {"a": [Region((0,), a)], "b": [Region((0,), b)]}
        with pytest.raises(ConfigError, match="`ready` names no event for 'b'; name every"):
            publisher.publish_packed(
                manifest, lambda *_: None, device=a.device, regions=regions, ready={"a": None}
            )
        assert not publisher.status().versions


def test_ready_names_are_looked_at_once_per_mapping_and_tensors_only_by_identity():
    """A new mapping of new tensors under the same names is checked again (its tensors are
    never compared by value: that raised for tensors of more than one element)."""
    from weightsync.errors import ConfigError
    from weightsync.sender.placement import ReadyCheck

    check, ready = ReadyCheck(), {"a": None, "b": None}
    first = {"a": torch.ones(4), "b": torch.ones(4)}
    check(first, first, ready, 1)

    def refuse():
        raise AssertionError("looked at again")
        yield

    check(first, refuse(), ready, 2)  # the same pair: not looked at
    second = {"a": torch.zeros(4), "b": torch.zeros(4)}
    check(second, second, ready, 3)
    with pytest.raises(ConfigError, match="no event for 'c'"):
        check({"c": torch.ones(2)}, ["c"], ready, 4)


def test_a_new_mapping_of_new_tensors_publishes_with_the_same_ready_events(sock_dir):
    """The second publish used to raise ``RuntimeError: Boolean value of Tensor ...`` from the
    ready check (CPU tensors: the stand-in events are polled on the host before each begin)."""

    class Event:
        looks = 0

        def query(self) -> bool:
            Event.looks += 1
            return True

    ready = {"a": Event(), "b": Event()}
    with Sender(f"unix:{sock_dir}/s.sock") as sender, Publisher(sender.address) as publisher:
        publisher.publish({"a": torch.ones(4), "b": torch.ones(4)}, 1, ready=ready)
        publisher.publish({"a": torch.zeros(4), "b": torch.zeros(4)}, 2, ready=ready)
        assert [v.version for v in sender.coordinator.status().versions] == [1, 2]
    assert Event.looks == 4
