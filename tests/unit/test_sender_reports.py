"""What ``Status`` says of a version: each receiver's direct bytes by route, as planned."""

from __future__ import annotations

import dataclasses

from tests.support.sender_parts import new_run, sender_parts
from weightsync.sender.direct_reads import DirectRead
from weightsync.sender.records import Outcome
from weightsync.sender.reports import version_status
from weightsync.v1 import weightsync_pb2 as pb


def test_each_receiver_outcome_carries_its_direct_bytes_by_route():
    reads = {
        "near": DirectRead(pb.BucketLayout(), (), {"local": 256, "peer": 0}),
        "far": DirectRead(pb.BucketLayout(), (), {"local": 0, "peer": 256}),
    }
    run = dataclasses.replace(new_run(sender_parts(), 1), direct_reads=reads)
    for rid in ("far", "mapped", "near"):
        run.outcomes[rid] = Outcome()
    got = {o.receiver_id: dict(o.direct_route_bytes) for o in version_status(run).receivers}
    assert got == {
        "far": {"local": 0, "peer": 256},
        "mapped": {},
        "near": {"local": 256, "peer": 0},
    }
