"""The Megatron node case's parts that need no megatron-core: the fill by HF name receivers
check against, the options, and the report's target (the processes:
tests/integration/test_bench_megatron.py)."""

from __future__ import annotations

import pytest
import torch

from weightsync.app.bench.config import BenchConfig
from weightsync.app.bench.engine_like import EngineLikeModel, EngineLikeTarget
from weightsync.app.bench.megatron_node import _Expected
from weightsync.app.bench.models import model_shape
from weightsync.app.bench.report import FLOOR, MEGATRON, NODE_LINK_FLOOR, WEIGHTSYNC, Report, Row
from weightsync.errors import ConfigError

CPU = torch.device("cpu")


@pytest.mark.parametrize("tp", [1, 2])
def test_a_receiver_checks_each_version_by_hf_name_bit_for_bit(tp):
    shape = model_shape("tiny-moe")
    target = EngineLikeTarget(EngineLikeModel(shape, CPU, tp=tp, rank=tp - 1))
    expected = _Expected(shape, CPU)
    expected.version = 3
    target.load([(name, expected(name)) for name in expected.specs])
    assert target.mismatch(expected.specs, expected, 3) == ""
    expected.version = 2  # every tensor's bytes differ from one version to the next
    assert target.mismatch(expected.specs, expected, 2).startswith(
        f"version 2: {len(expected.specs)} tensor(s) differ"
    )
    expected.version = 3
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    target.resolve(name)[7, 9].view(torch.int16).bitwise_xor_(1)
    assert target.mismatch(expected.specs, expected, 3) == (
        f"version 3: 1 tensor(s) differ, first ['{name}']"
    )


def test_megatron_options_need_the_node_case_and_an_ep_size_that_divides_it():
    assert BenchConfig(gpus=4, trainer_tps=(1, 2), megatron=True).megatron_ep == 2
    with pytest.raises(ConfigError, match="--megatron is the node case's"):
        BenchConfig(megatron=True)
    with pytest.raises(ConfigError, match="--megatron-ep 4: .* divides --gpus 2"):
        BenchConfig(model="tiny-moe", gpus=2, trainer_tps=(2,), megatron=True, megatron_ep=4)
    assert BenchConfig(model="tiny", gpus=1, megatron=True).megatron  # dense: no EP


def test_megatron_rows_are_held_within_1_1x_of_the_synthetic_row_of_their_layout():
    node, gb = "node: 4 GPUs", 15_000_000_000
    rows = []
    for layout, synthetic, megatron in (
        ("TP=2 x DP=2", 0.030, 0.032),
        ("TP=1 x DP=4", 0.010, 0.012),
    ):
        rows += [
            Row(FLOOR, NODE_LINK_FLOOR, "-", layout, node, gb, (0.020,)),
            Row(WEIGHTSYNC, "direct", "cuda_ipc", layout, node, gb, (synthetic,), bit_exact=True),
            Row(WEIGHTSYNC, MEGATRON, "cuda_ipc", layout, node, gb, (megatron,), bit_exact=True),
        ]
    report = Report({"gpus": 4, "bucket_size_bytes": 0}, rows)
    met = {
        t["target"]: (t["value"], t["met"]) for t in report.targets() if "synthetic" in t["target"]
    }
    assert list(met.values()) == [(round(0.032 / 0.030, 3), True), (1.2, False)]
    assert report.ratios(rows[2])["x_floor"] == pytest.approx(1.6)  # the layout's floor
