"""A whole node, every trainer rank a source (issue 11): one publisher rank process per GPU,
trainer TP=1 x DP=N (each holding the whole model there) or TP=2 x DP=N/2 (each a TP shard),
and N receiver processes, one per GPU (engine TP=1 x N or TP=2 x N/2), on the direct path:
with TP=1 each receiver reads only its own GPU's copy; with a TP=2 trainer, the shards' pieces
in place, its own GPU's first. The floor, in the same run: every GPU copying its share from its
own memory at once, in separate processes. The same case as ``weightsync bench --gpus N``
(``weightsync.app.bench.node``).

Run on a GPU machine (prints the timing and the floor)::

    .venv/bin/python -m pytest -m gpu tests/gpu/test_node_sources.py -s

Settings (environment): ``WS_NODE_GPUS`` (default: every GPU), ``WS_NODE_MODEL`` (a
``weightsync bench`` model, default ``qwen2.5-7b``), ``WS_NODE_LAYERS`` (default: all),
``WS_NODE_VERSIONS`` (measured, default 3, after one warm-up), ``WS_NODE_FLOOR_REPS``
(default 5). The engines run TP=1 x N, then TP=2 x N/2 (each rank keeping vLLM's shard), for
each trainer.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("trainer_tp", [1, 2], ids=["trainer TP=1", "trainer TP=2"])
@pytest.mark.parametrize("engine_tp", [1, 2], ids=["engines TP=1", "engines TP=2"])
def test_every_trainer_rank_is_a_source_each_gpu_reading_its_own_first(engine_tp, trainer_tp):
    from weightsync.app.bench.models import model_shape
    from weightsync.app.bench.node import measure_node, summary

    n = int(os.environ.get("WS_NODE_GPUS", "0")) or torch.cuda.device_count()
    if n % engine_tp or n % trainer_tp:
        pytest.skip(f"TP={max(engine_tp, trainer_tp)} needs a multiple of it GPUs, not {n}")
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
        trainer_tp=trainer_tp,
    )
    print("\n" + summary(run))
    assert run.bit_exact
    assert_routes(run, engine_tp, trainer_tp)


def assert_routes(run, engine_tp: int, trainer_tp: int) -> None:
    """Each receiver declared its shard (engine_like's kept()): the plan counts what it keeps,
    read from its own GPU wherever a copy is there."""
    local, peer = run.route_bytes["local"], run.route_bytes["peer"]
    assert local + peer == run.gpus * run.kept_nbytes
    assert run.kept_nbytes < run.nbytes / engine_tp * 1.01
    if trainer_tp == 1:
        assert peer == 0
    elif engine_tp == trainer_tp:  # the same shards: only replicated norms come from a peer
        assert peer < 0.01 * local
    else:  # a whole engine reads the other TP rank's half from its GPU
        assert abs(peer - local) < 0.01 * local


@pytest.mark.parametrize("trainer_tp", [1, 2], ids=["trainer TP=1", "trainer TP=2"])
@pytest.mark.parametrize("engine_tp", [1, 2], ids=["engines TP=1", "engines TP=2"])
def test_a_moe_model_reaches_every_engine_rank_bit_exact(engine_tp, trainer_tp):
    """The same node case on the tiny MoE shape (fused experts, sharded per expert at TP=2)."""
    from weightsync.app.bench.models import model_shape
    from weightsync.app.bench.node import measure_node, summary

    n = torch.cuda.device_count()
    if n % engine_tp or n % trainer_tp:
        pytest.skip(f"TP={max(engine_tp, trainer_tp)} needs a multiple of it GPUs, not {n}")
    run = measure_node(model_shape("tiny-moe"), n, 2, 1, 2, 120, engine_tp, trainer_tp)
    print("\n" + summary(run))
    assert run.bit_exact
    assert_routes(run, engine_tp, trainer_tp)


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("trainer_tp", [1, 2], ids=["trainer TP=1", "trainer TP=2"])
@pytest.mark.parametrize("engine_tp", [1, 2], ids=["engines TP=1", "engines TP=2"])
def test_two_ranks_of_each_sharing_one_gpu_reach_every_engine_rank_bit_exact(
    model, engine_tp, trainer_tp
):
    """The node case with its two publisher ranks and two receivers all on GPU 0: the
    many-rank paths (DP or TP publishers, engine TP ranks declaring their shards, each loading
    only its shard through the copy kernel) on CUDA, on a machine of one GPU. Every copy is on
    the receivers' GPU, so every byte is read locally."""
    from weightsync.app.bench.models import model_shape
    from weightsync.app.bench.node import measure_node

    run = measure_node(model_shape(model), 2, 2, 1, 1, 120, engine_tp, trainer_tp, devices=1)
    assert run.bit_exact
    assert run.route_bytes["peer"] == 0
    assert run.route_bytes["local"] == run.gpus * run.kept_nbytes
    assert run.kept_nbytes < run.nbytes / engine_tp * 1.01
