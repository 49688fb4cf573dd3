"""Exact deltas on the broadcast path (issue 36; protocol §5.1), over gloo on CPU: the same
code runs NCCL for CUDA staging.

Every version changes a few elements of each tensor, as an RL step at a small learning rate
changes a few bf16 values. Versions arrive bit-exact while fewer bytes are broadcast
(``VersionStatus.broadcast_bytes``, ``delta_buckets``); a receiver that missed a version, a
restarted engine and a late joiner get full bytes and are exact; a kept base that changed on
the receiver fails the version there before any write, naming the bucket, and the next
version arrives in full and exact.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.support import holder_module, next_outcomes, start_receivers, sync_in_thread
from tests.support.models import digests
from tests.support.processes import fault_model, kill_receiver
from tests.support.waiting import wait_until
from weightsync.errors import ReceiverFailedError, WrongBaseError
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher
from weightsync.sender.daemon import Sender

MIB = 1 << 20


def nudge(tensors: dict[str, torch.Tensor], seed: int, count: int = 20) -> None:
    """Change ``count`` elements of every floating tensor in place (a small optimizer step)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in tensors.values():
            if t.is_floating_point():
                flat = t.view(-1)
                where = torch.randint(0, flat.numel(), (count,), generator=g)
                flat[where] = torch.randn(count, generator=g).to(t.dtype)


def bf16_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        f"layers.{i}.weight": torch.randn(4096, generator=g).to(torch.bfloat16) for i in range(4)
    }
    out["norm.weight"] = torch.randn(64, generator=g)  # float32 beside the bf16
    return out


def bits_equal(model: torch.nn.Module, sent: dict[str, torch.Tensor]) -> bool:
    state = model.state_dict()
    return all(
        torch.equal(state[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
        for n, t in sent.items()
    )


def status_of(publisher: Publisher, version: int):
    return [s for s in publisher.status().versions if s.version == version][-1]


def apply(receivers, publisher: Publisher, sent: dict[str, torch.Tensor], version: int) -> list:
    """Publish ``version`` while every receiver syncs; returns each receiver's result."""
    threads = [sync_in_thread(r) for r in receivers]
    try:
        publisher.publish(sent, version, wait=True, timeout_s=60)
    except ReceiverFailedError:
        pass  # the receivers' own results say which and why
    return [t.finish(60)[0] for t, _ in threads]


def test_versions_arrive_exact_as_deltas_and_fewer_bytes_cross(sock_dir):
    sent = bf16_weights()
    models = [holder_module({n: torch.zeros_like(t) for n, t in sent.items()}) for _ in range(2)]
    address = f"unix:{os.path.join(sock_dir, 's.sock')}"
    with Sender(address, bucket_size_bytes=8192, transport="nccl", delta_bytes=MIB) as sender:
        receivers = [TorchReceiver(m, sender.address, delta_bytes=MIB) for m in models]
        publisher = Publisher(sender.address)
        for version in range(1, 6):
            if version > 1:
                nudge(sent, version)
            assert apply(receivers, publisher, sent, version) == [version, version]
            assert all(bits_equal(m, sent) for m in models), version
            status = status_of(publisher, version)
            if version == 1:  # nobody holds a base yet
                assert status.delta_buckets == 0
                assert status.broadcast_bytes == status.staged_bytes
            else:
                assert status.delta_buckets == status.num_buckets
                assert status.broadcast_bytes < status.staged_bytes / 10, status
        for r in receivers:
            r.close()


def test_a_receiver_that_did_not_ask_for_deltas_gets_none_nor_does_its_group(sock_dir):
    sent = bf16_weights()
    models = [holder_module({n: torch.zeros_like(t) for n, t in sent.items()}) for _ in range(2)]
    address = f"unix:{os.path.join(sock_dir, 's.sock')}"
    with Sender(address, bucket_size_bytes=8192, transport="nccl", delta_bytes=MIB) as sender:
        receivers = [
            TorchReceiver(models[0], sender.address, delta_bytes=MIB),
            TorchReceiver(models[1], sender.address, delta_bytes=0),
        ]
        publisher = Publisher(sender.address)
        for version in (1, 2, 3):
            nudge(sent, version)
            assert apply(receivers, publisher, sent, version) == [version, version]
            assert all(bits_equal(m, sent) for m in models), version
            status = status_of(publisher, version)
            assert status.delta_buckets == 0
            assert status.broadcast_bytes == status.staged_bytes
        for r in receivers:
            r.close()


def test_a_changed_base_fails_its_version_before_any_write_and_the_next_is_full(sock_dir):
    """The planted fault: a byte of a kept base flipped on the receiver after it applied."""
    sent = bf16_weights()
    model = holder_module({n: torch.zeros_like(t) for n, t in sent.items()})
    address = f"unix:{os.path.join(sock_dir, 's.sock')}"
    with Sender(address, bucket_size_bytes=8192, transport="nccl", delta_bytes=MIB) as sender:
        receiver = TorchReceiver(model, sender.address, delta_bytes=MIB)
        publisher = Publisher(sender.address)
        for version in (1, 2):
            nudge(sent, version)
            assert apply([receiver], publisher, sent, version) == [version]
        held = {n: t.clone() for n, t in model.state_dict().items()}
        (link,) = receiver._links
        link.broadcast.bases._kept[2].data[17] ^= 0xFF
        nudge(sent, 3)
        (failed,) = apply([receiver], publisher, sent, 3)
        assert isinstance(failed, WrongBaseError), failed
        assert "bucket 2" in str(failed) and "version 3 fails here before any write" in str(failed)
        assert not receiver.dirty and bits_equal(model, held)  # nothing of version 3 loaded
        (seen,) = publisher.status().receivers  # and the sender knows it (VersionApplied.untouched)
        assert (seen.state, seen.applied_version) == ("idle", 2), seen
        assert status_of(publisher, 3).delta_buckets > 0  # the sender had sent deltas
        nudge(sent, 4)
        assert apply([receiver], publisher, sent, 4) == [4]
        assert bits_equal(model, sent)
        status = status_of(publisher, 4)
        assert status.delta_buckets == 0 and status.broadcast_bytes == status.staged_bytes
        nudge(sent, 5)
        assert apply([receiver], publisher, sent, 5) == [5]
        assert bits_equal(model, sent) and status_of(publisher, 5).delta_buckets > 0
        receiver.close()


@pytest.mark.timeout(300)
def test_missed_version_restart_and_late_joiner_on_other_hosts_get_full_bytes(sock_dir):
    """Receivers in processes of their own, on "other hosts" (broadcast over gloo): one leaves
    after version 2 and restarts under its id after version 3, a new one joins then; both
    catch up on version 3, version 4 goes to all in full, version 5 as deltas again."""
    address = f"unix:{os.path.join(sock_dir, 's.sock')}"
    env = {"WEIGHTSYNC_HOST_ID": "another-host", "WEIGHTSYNC_RECEIVER_DELTA_BYTES": str(16 * MIB)}
    trainer = fault_model(0)
    weights = dict(trainer.state_dict())
    expected: dict[int, dict[str, str]] = {}
    with Sender(
        address, bucket_size_bytes=MIB, delta_bytes=16 * MIB, retain_bytes=16 * MIB
    ) as sender:
        publisher = Publisher(sender.address)

        def publish(version: int) -> None:
            nudge(weights, version, count=200)
            publisher.publish(weights, version, wait=True, timeout_s=120)
            expected[version] = digests(trainer)

        procs, out = start_receivers(
            address, ["a", "b"], syncs=5, env={"a": env, "b": env}, model_of=fault_model
        )
        got = []
        for version in (1, 2):
            publish(version)
            got += next_outcomes(out, 2, timeout=120)
        kill_receiver(procs[1], out)  # "b" misses version 3
        wait_until(
            lambda: (
                not any(r.connected for r in publisher.status().receivers if r.receiver_id == "b")
            ),
            30,
            "the sender to see receiver b gone",
        )
        publish(3)
        got += next_outcomes(out, 1, timeout=120)
        more, out = start_receivers(
            address, ["b", "c"], syncs=3, env={"b": env, "c": env}, model_of=fault_model, out=out
        )
        got += next_outcomes(out, 2, timeout=120)  # both catch up on version 3
        for version in (4, 5):
            publish(version)
            got += next_outcomes(out, 3, timeout=120)
        for outcome in got:
            assert outcome.state == "applied", outcome
            assert outcome.digests == expected[outcome.version], outcome
        assert sorted((o.receiver_id, o.version) for o in got) == sorted(
            [("a", v) for v in range(1, 6)]
            + [("b", 1), ("b", 2)]
            + [(r, v) for r in "bc" for v in (3, 4, 5)]
        )
        counts = {v: status_of(publisher, v) for v in range(1, 6)}
        assert [counts[v].delta_buckets > 0 for v in range(1, 6)] == [
            False,
            True,
            True,
            False,  # "b" and "c" hold no base: their group gets full bytes
            True,
        ]
        for v in (2, 3, 5):
            assert counts[v].broadcast_bytes < counts[v].staged_bytes / 4, counts[v]
        for p in [procs[0], *more]:
            p.join(60)
