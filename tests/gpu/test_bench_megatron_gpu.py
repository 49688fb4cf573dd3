"""``weightsync bench --gpus N --megatron`` on GPUs (issue 32): a real megatron-core trainer
(GPTModel, local spec, bf16 on each rank's GPU, NCCL process group; MoE with EP=2) publishing
with ``MegatronPublisher`` (direct), engine-like receivers reading its shards in place over
CUDA IPC, every version bit for bit; its rows beside the synthetic trainer's of the same
layouts, held to their floors and within 1.1x of them (reported, not asserted).

Run on a GPU machine (prints the table)::

    .venv/bin/python -m pytest -m gpu tests/gpu/test_bench_megatron_gpu.py -s

Settings (environment): ``WS_MEGATRON_GPUS`` (default: every GPU, at least 2),
``WS_MEGATRON_MODELS`` (comma-separated, default ``tiny,tiny-moe``; e.g. ``qwen2.5-7b``),
``WS_MEGATRON_LAYERS``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.support.bench import bench
from weightsync.app.bench.models import model_shape

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.megatron,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


@pytest.mark.parametrize("model", os.environ.get("WS_MEGATRON_MODELS", "tiny,tiny-moe").split(","))
def test_megatron_trainer_rows_beside_the_synthetic_ones_read_in_place(tmp_path, model):
    gpus = int(os.environ.get("WS_MEGATRON_GPUS", "0")) or torch.cuda.device_count()
    layers = os.environ.get("WS_MEGATRON_LAYERS")
    tps = "1,2"  # TP=1 x DP=N and TP=2 x DP=N/2
    code = bench(
        ["--model", model, "--device", "cuda", "--tp", "", "--no-baselines", "--no-floors"]
        + ["--gpus", str(gpus), "--trainer-tp", tps, "--megatron", "--versions", "3"]
        + (["--layers", layers] if layers else [])
        + ["--timeout-s", "300", "--out", str(tmp_path)]
    )
    data = json.loads((tmp_path / f"bench-{model}.json").read_text())
    rows = [r for r in data["rows"] if r["placement"] == f"node: {gpus} GPUs"]
    synced = {(r["name"], r["layout"]): r for r in rows if r["kind"] == "weightsync"}
    layouts = [f"TP={tp} x DP={gpus // tp}" for tp in (1, 2)]
    # An MoE trainer's experts are split over its ranks (EP=2): a layout, and floors, of its own.
    ep = ", EP=2" if model_shape(model, None).is_moe else ""
    megatron = {("megatron", lo + ep) for lo in layouts}
    assert set(synced) == {("direct", lo) for lo in layouts} | megatron
    for (name, layout), r in synced.items():
        print(
            name, layout, f"{r['seconds'] * 1e3:.2f} ms", f"x floor {r['x_floor']:.2f}", r["note"]
        )
        assert r["bit_exact"] is True and len(r["samples_s"]) == 3, r
        assert r["transport"] == "cuda_ipc" and "staged" not in r["note"], r  # read in place
    targets = [t for t in data["targets"] if "x the synthetic trainer" in t["target"]]
    for t in targets:
        print("target", t)
    assert len(targets) == (0 if ep else 2)  # only a synthetic row of the same layout compares
    assert code == 0
