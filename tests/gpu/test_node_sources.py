"""A whole node, every trainer rank a source (issue 11): trainer TP=1 x DP=N, one publisher
rank process per GPU each holding the whole model there, and N receiver processes, one per
GPU (engine TP=1 x N), on the direct path: each receiver reads only its own GPU's copy. The
floor, in the same run: every GPU copying the model from its own memory at once, in separate
processes. The same case as ``weightsync bench --gpus N`` (``weightsync.app.bench.node``).

Run on a GPU machine (prints the timing and the floor)::

    .venv/bin/python -m pytest -m gpu tests/gpu/test_node_sources.py -s

Settings (environment): ``WS_NODE_GPUS`` (default: every GPU), ``WS_NODE_MODEL`` (a
``weightsync bench`` model, default ``qwen2.5-7b``), ``WS_NODE_LAYERS`` (default: all),
``WS_NODE_VERSIONS`` (measured, default 3, after one warm-up), ``WS_NODE_FLOOR_REPS``
(default 5). The engines run TP=1 x N, then TP=2 x N/2 (each rank keeping vLLM's shard).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("engine_tp", [1, 2])
def test_dp_sources_each_gpu_reads_its_own_copy_against_the_floor(engine_tp):
    from weightsync.app.bench.models import model_shape
    from weightsync.app.bench.node import measure_node, summary

    n = int(os.environ.get("WS_NODE_GPUS", "0")) or torch.cuda.device_count()
    if n % engine_tp:
        pytest.skip(f"engines TP={engine_tp} need a multiple of {engine_tp} GPUs, not {n}")
    shape = model_shape(
        os.environ.get("WS_NODE_MODEL", "qwen2.5-7b"),
        int(os.environ.get("WS_NODE_LAYERS", "0")) or None,
    )
    run = measure_node(
        shape,
        n,
        versions=int(os.environ.get("WS_NODE_VERSIONS", "3")),
        warmup=1,
        reps=int(os.environ.get("WS_NODE_FLOOR_REPS", "5")),
        timeout_s=300,
        engine_tp=engine_tp,
    )
    print("\n" + summary(run))
    assert run.bit_exact
    # Each receiver declared its shard (engine_like's kept()): the plan counts what it keeps.
    assert run.route_bytes["local"] == n * run.kept_nbytes and run.route_bytes["peer"] == 0
    assert run.kept_nbytes < run.nbytes / engine_tp * 1.01


@pytest.mark.parametrize("engine_tp", [1, 2])
def test_a_moe_model_reaches_every_engine_rank_bit_exact(engine_tp):
    """The same node case on the tiny MoE shape (fused experts, sharded per expert at TP=2)."""
    from weightsync.app.bench.models import model_shape
    from weightsync.app.bench.node import measure_node, summary

    n = torch.cuda.device_count()
    if n % engine_tp:
        pytest.skip(f"engines TP={engine_tp} need a multiple of {engine_tp} GPUs, not {n}")
    run = measure_node(model_shape("tiny-moe"), n, 2, 1, 2, 120, engine_tp)
    print("\n" + summary(run))
    assert run.bit_exact
    assert run.route_bytes["local"] == n * run.kept_nbytes and run.route_bytes["peer"] == 0
