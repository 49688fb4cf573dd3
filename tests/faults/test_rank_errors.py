"""Issue 16 item 10: a Megatron planning error on one trainer rank reaches every rank at once.

Real megatron-core ranks on CPU over gloo. One rank is given a fault the others do not have;
before, that rank raised alone and the others waited in the coverage check's collective until
the process-group timeout (120 s in ``tests.support.megatron.launch``). Now every rank raises
the same error, naming the failed rank, its coordinates and the parameter, within seconds.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.support import megatron as ms

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

FAULTS = {
    # a parameter no rule knows, on pipeline stage 1 only
    "unknown_name_on_pp1": ({"tp": 1, "pp": 2}, "llama_gqa", "tp0/1 pp1/2", "bogus_scale"),
    # a shape the HF config contradicts, on tensor-parallel rank 1 only
    "bad_shape_on_tp1": ({"tp": 2, "pp": 1}, "qwen2_bias", "tp1/2 pp0/1", "linear_fc2.weight"),
}


def faulty_rank_worker(rank: int, sizes: dict, fault: str):
    """Build the model, break it on rank 1 only, construct the publisher on every rank at
    the same moment; returns (error type, message, seconds until it raised)."""
    import torch.distributed as dist

    from weightsync.sender.megatron import MegatronPublisher

    _, case_name, _, _ = FAULTS[fault]
    case = ms.CASES[case_name]
    chunks = ms.build_chunks(case, sizes)
    if rank == 1:
        layer = chunks[0].decoder.layers[0]
        if fault == "unknown_name_on_pp1":
            layer.register_parameter("bogus_scale", torch.nn.Parameter(torch.ones(4)))
        else:
            weight = layer.mlp.linear_fc2.weight
            weight.data = torch.zeros(weight.shape[0], weight.shape[1] + 8)
    dist.barrier()
    start = time.monotonic()
    try:
        # No sender: planning fails before any connection is tried.
        MegatronPublisher(chunks, ms.hf_config(case), "unix:/nonexistent/s.sock")
    except Exception as e:  # the assertion compares what every rank raised
        return type(e).__name__, str(e), time.monotonic() - start
    return "nothing raised", "", time.monotonic() - start


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_planning_error_on_one_rank_is_raised_on_every_rank_at_once(fault, tmp_path):
    sizes, _, coordinates, tensor = FAULTS[fault]
    results = ms.launch(tmp_path, sizes, faulty_rank_worker, fault)
    assert sorted(results) == [0, 1]
    messages = {results[r][1] for r in results}
    assert len(messages) == 1, f"the ranks raised different errors: {results}"
    for kind, message, seconds in results.values():
        assert kind == "PlanError", message
        assert seconds < 10, f"raised after {seconds:.1f} s: a collective timed out"
    (message,) = messages
    assert "planning the Megatron -> HF conversion failed on 1 of 2 trainer ranks" in message
    assert f"rank 1 ({coordinates}" in message and tensor in message
    assert "rank 0 (" not in message
