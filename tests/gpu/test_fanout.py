"""NCCL fan-out from one trainer GPU (issue 32): ``Sender(transport="nccl")``, the trainer
(TP=1, a 7B shape, its tensors allocated one by one) on GPU 0, a ``TorchReceiver`` process on
each GPU (4 where the machine has them, else 2), ``publish(wait=True)``: the median version
against one NCCL broadcast of the same bytes from GPU 0 to the other GPUs, measured in the same
test (``weightsync.app.bench.fanout``, the bench's ``--fanout`` row), bit-exact every version.

The limit is a ratio to that broadcast, never a wall-clock bound. Issue 32 reported 269.5 ms
against a 41 ms broadcast (6.5x; about 75 ms, 1.8x, at an earlier commit). The pipeline sends
every byte once over NVLink, so its floor is that one broadcast; what it adds is the staging
copy of the first bucket, the loads of the last, and the copies that share GPU 0 and GPU 1 with
the broadcasts (on 2 x H200 about 1.5x). ``LIMIT`` (2.0) fails anything that adds per-version
work of the order of the broadcast itself (a group rebuilt every version, a host round trip per
bucket, a second pass over the bytes) while leaving room for run-to-run noise;
``WS_FANOUT_LIMIT`` tightens it (issue 32's target is 1.2). Also without a receiver on GPU 0:
then GPU 0 runs only the sender's kernels (on 2 x H200 about 1.15x against 1.5-1.7x with it).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

LIMIT = float(os.environ.get("WS_FANOUT_LIMIT", "2.0"))


@pytest.mark.parametrize("local_receiver", [True, False], ids=["gpu0-receiver", "no-gpu0-receiver"])
def test_nccl_fanout_is_within_a_ratio_of_one_broadcast(local_receiver):
    from weightsync.app.bench.fanout import measure_fanout, summary
    from weightsync.app.bench.models import model_shape

    gpus = min(torch.cuda.device_count(), 4)
    run = measure_fanout(
        model_shape("qwen2.5-7b"),
        gpus,
        versions=5,
        warmup=1,
        timeout_s=120.0,
        local_receiver=local_receiver,
    )
    print(summary(run))
    print("publish ms:", [round(s * 1e3, 1) for s in run.publish_s])
    print("broadcast ms:", [round(s * 1e3, 1) for s in run.broadcast_s])
    assert run.bit_exact
    assert len(run.publish_s) == 5 and len(run.broadcast_s) == 5
    # Every receiver but GPU 0's got every byte by broadcast; GPU 0's mapped the staging.
    assert run.receivers == (gpus if local_receiver else gpus - 1)
    if run.route_bytes is not None:
        assert run.route_bytes["broadcast"] == run.nbytes * (gpus - 1)
        assert run.route_bytes["staged"] == (run.nbytes if local_receiver else 0)
    assert run.ratio is not None and run.ratio <= LIMIT, summary(run)
