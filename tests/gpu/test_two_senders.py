"""Two senders, one per "host", on GPUs (issue 12): GPU 0 and GPU 1 play two hosts by
``WEIGHTSYNC_HOST_ID``; a PP=2 trainer with a publisher per host sends its stage's part
through its host's sender; a receiver per GPU, registered with both, maps its own host's part
by CUDA IPC and gets the other's by NCCL broadcast. Then one sender sends everything. The
same case as ``weightsync bench --hosts 2`` (``weightsync.app.bench.hosts``), on a 7B shape cut
to 4 layers (about 4 GB: eight 512 MiB buckets, so both senders pipeline several).

Before receives got a stream of their own, this hung: a receiver's broadcast receive from one
sender queued behind its reads of the other sender's buffers (an NCCL timeout after 120 s).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


@pytest.mark.parametrize(
    ("model", "layers", "engine_tp"),
    [("qwen2.5-7b", 4, 1), ("qwen2.5-7b", 4, 2), ("tiny-moe", None, 2)],
)
def test_two_senders_at_once_are_bit_exact_on_gpus(model, layers, engine_tp):
    """With engines TP=2 (GPU 0's receiver rank 0, GPU 1's rank 1) each sender broadcasts
    the other host's receiver only its shard, over NCCL, from the second version on."""
    from weightsync.app.bench.hosts import measure_hosts, summary
    from weightsync.app.bench.models import model_shape

    shape = model_shape(model, layers=layers)
    run = measure_hosts(shape, 2, 2, 1, 90.0, engine_tp)
    print(summary(run))
    assert run.bit_exact
    assert len(run.two_senders_s) == 2 and len(run.one_sender_s) == 2
    assert all(a > 0 and b > 0 for a, b in zip(run.two_senders_s, run.one_sender_s, strict=True))
    # Two senders: each part crosses once to the other host's receiver (whole, or its shard);
    # what receivers took (the bytes sent also count the buckets' alignment).
    crossed, _ = run.received_bytes
    assert crossed <= run.broadcast_bytes[0]
    if engine_tp == 1:
        assert crossed == run.nbytes
    else:
        assert run.nbytes * 0.45 < crossed < run.nbytes * 0.55
