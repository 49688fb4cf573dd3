"""The bench's dense and MoE layouts through every GPU path, bit for bit (2 GPUs).

Run on a GPU machine: ``python -m pytest -m gpu tests/gpu -s`` (CI skips the ``gpu`` marker).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.bench import bench

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


@pytest.mark.parametrize(("model", "bucket_mb"), [("tiny", "0.25"), ("tiny-moe", "0.0625")])
def test_dense_and_moe_layouts_are_bit_exact_on_every_gpu_path(tmp_path, model, bucket_mb):
    code = bench(
        ["--model", model, "--device", "cuda", "--bucket-size-mb", bucket_mb, "--versions", "2"]
        + ["--no-baselines", "--no-floors", "--timeout-s", "60", "--out", str(tmp_path)]
    )
    rows = json.loads((tmp_path / f"bench-{model}.json").read_text())["rows"]
    measured = {(r["name"], r["layout"], r["placement"]): r for r in rows if r["samples_s"]}
    assert set(measured) >= {
        ("staged", "TP=1", "same GPU"),
        ("staged", "TP=2", "same GPU"),
        ("direct", "TP=1", "same GPU"),
        ("direct", "TP=2", "same GPU"),
        ("staged", "TP=1", "other GPU"),
        ("nccl", "TP=1", "other GPU"),
        ("nccl", "TP=2", "other GPU"),
    }
    assert all(r["bit_exact"] is True for r in measured.values()), measured
    assert code == 0
