"""The bench's NCCL fan-out case (issue 32) off the GPU: its report rows, their floor and
target, its option, and the trainer/receiver tensors it builds (the measurement itself runs in
tests/gpu/test_fanout.py)."""

from __future__ import annotations

import pytest
import torch

from weightsync.app.bench.config import BenchConfig
from weightsync.app.bench.fanout import FanoutRun, _module, _offsets, _views
from weightsync.app.bench.models import hf_specs, model_shape
from weightsync.app.bench.report import Report
from weightsync.errors import ConfigError


def test_fanout_row_is_held_against_its_own_broadcast_and_issue_32s_target():
    run = FanoutRun(2, 1000, (0.060, 0.062, 0.064), (0.040, 0.041, 0.042), True, (), {})
    report = Report({"gpus": 2, "bucket_size_bytes": 0}, run.rows())
    floor, row = report.rows
    assert floor.kind == "floor" and row.name == "nccl fan-out"
    assert report.ratios(row)["x_floor"] == pytest.approx(0.062 / 0.041)
    (target,) = report.targets()
    assert "issue 32" in target["target"] and target["limit"] == 1.2 and not target["met"]
    assert run.ratio == pytest.approx(0.062 / 0.041)


def test_fanout_without_a_receiver_on_the_trainers_gpu_says_so_and_keeps_its_floor():
    run = FanoutRun(1, 1000, (0.047,), (0.041,), True, (), {}, local_receiver=False)
    report = Report({"gpus": 2, "bucket_size_bytes": 0}, run.rows())
    floor, row = report.rows
    assert row.placement == floor.placement == "fan-out: GPU 0 -> 1 other GPU(s)"
    assert report.ratios(row)["x_floor"] == pytest.approx(0.047 / 0.041)
    assert FanoutRun(2, 1000, (0.06,), (), True).rows()[0].placement == "fan-out: GPU 0 -> 2 GPUs"


def test_fanout_needs_two_gpus_or_none():
    assert BenchConfig(fanout=2).fanout == 2
    with pytest.raises(ConfigError, match="--fanout 1"):
        BenchConfig(fanout=1)


def test_fanout_tensors_match_by_name_and_bytes():
    specs = hf_specs(model_shape("tiny"))
    offsets, total = _offsets(specs)
    assert all(o % 256 == 0 for o in offsets) and total >= sum(s.nbytes for s in specs)
    flat = torch.arange(total, dtype=torch.int64).remainder(251).to(torch.uint8)
    views = _views(flat, specs, offsets)
    module = _module(specs, torch.device("cpu"))
    live = module.state_dict()
    assert list(live) == [s.name for s in specs]
    for spec in specs:
        assert live[spec.name].shape == views[spec.name].shape == spec.shape
        assert live[spec.name].dtype == views[spec.name].dtype
