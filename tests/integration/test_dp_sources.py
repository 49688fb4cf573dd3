"""Every trainer rank a source (issue 11), over shm across processes: data-parallel publisher
ranks offer the same tensors, receivers in their own processes get every version bit-exact,
and the sender packs each staged bucket itself, once, from one copy."""

from __future__ import annotations

import queue

from tests.support import TinyNet, assert_applied, digests, next_outcomes, start_receivers, step
from tests.support.publishers import start_publishers

VERSIONS = (1, 2, 3)


def test_dp_replicas_in_processes_are_packed_once_by_the_sender(sender, monkeypatch):
    import weightsync.sender.packing as packing

    copies_per_entry: list[tuple[str, int]] = []
    region_copies = packing.region_copies

    def counted(buffer, entry, regions):
        pairs = region_copies(buffer, entry, regions)
        copies_per_entry.append((entry.name, len(pairs)))
        return pairs

    monkeypatch.setattr(packing, "region_copies", counted)
    receivers, outcomes = start_receivers(sender.address, ["r0", "r1", "r2"], syncs=len(VERSIONS))
    publishers, published = start_publishers(sender.address, 2, seed=7, versions=VERSIONS)
    trainer, expected = TinyNet(7), {}
    for version in VERSIONS:
        step(trainer, version)
        expected[version] = digests(trainer)
    assert_applied(next_outcomes(outcomes, 3 * len(VERSIONS)), expected)
    reports = []
    for _ in range(2 * len(VERSIONS)):
        try:
            reports.append(published.get(timeout=60))
        except queue.Empty:
            raise AssertionError(f"publisher ranks reported only {reports}") from None
    total = sum(t.numel() * t.element_size() for t in trainer.state_dict().values())
    for r in reports:
        assert not r.error, r.error
        assert r.sender_packed, r
        assert r.route_bytes == {"local": 0, "peer": 0, "staged": 3 * total, "broadcast": 0}
    # Each bucket entry was copied from one region: one copy of each tensor, never two.
    assert {name for name, _ in copies_per_entry} == set(trainer.state_dict())
    assert {n for _, n in copies_per_entry} == {1}
    for p in (*publishers, *receivers):
        p.join(timeout=30)
        assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"
