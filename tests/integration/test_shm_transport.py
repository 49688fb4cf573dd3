"""The shm transport between real processes: what one writes, the other reads."""

from __future__ import annotations

import torch

from tests.support import children
from weightsync.transports import get_transport


def _child(handle_bytes: bytes, out) -> None:
    from weightsync.transports import MappedBuffers
    from weightsync.v1 import weightsync_pb2 as pb

    handle = pb.BufferHandle.FromString(handle_bytes)
    buf = MappedBuffers().get(handle)
    out.put(int(buf.sum()))
    buf.copy_(torch.arange(buf.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))
    out.put("written")


def test_shm_is_shared_both_ways_across_processes():
    shm = get_transport("shm")
    staging = shm.allocate(1 << 16, torch.device("cpu"))
    try:
        staging.tensor.fill_(3)
        out = children.queue()
        p = children.process(_child, (staging.handle.SerializeToString(), out))
        p.start()
        assert out.get(timeout=60) == 3 * (1 << 16)
        assert out.get(timeout=60) == "written"
        p.join(30)
        expected = torch.arange(1 << 16, dtype=torch.int64).remainder(251).to(torch.uint8)
        assert torch.equal(staging.tensor, expected)
    finally:
        shm.release(staging)
