"""``weightsync bench --gpus N --megatron`` on CPU: the node case's processes with a real
megatron-core trainer (gloo process group, ``MegatronPublisher`` ranks, shm staging) beside the
synthetic trainer, engine-like receivers checking every version bit for bit. The GPU run is
tests/gpu/test_bench_megatron_gpu.py."""

from __future__ import annotations

import json

import pytest

from tests.support.bench import bench

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron


@pytest.mark.parametrize(
    "model, trainer_tps",
    [("tiny", ["TP=2 x DP=1"]), ("tiny-moe", ["TP=1 x DP=2", "TP=2 x DP=1"])],
)
def test_megatron_rows_come_out_beside_the_synthetic_ones_bit_exact(model, trainer_tps, tmp_path):
    tps = ",".join(layout[3] for layout in trainer_tps)
    code = bench(
        ["--model", model, "--device", "cpu", "--tp", "", "--no-baselines", "--no-floors"]
        + ["--gpus", "2", "--trainer-tp", tps, "--megatron", "--versions", "2"]
        + ["--out", str(tmp_path)]
    )
    assert code == 0
    rows = json.loads((tmp_path / f"bench-{model}.json").read_text())["rows"]
    node = [r for r in rows if r["placement"] == "node: 2 CPU processes"]
    want = []
    for layout in trainer_tps:
        want += [("floor", "every GPU its share", layout), ("floor", "interconnect floor", layout)]
        want += [("weightsync", "direct", layout)]
        if model == "tiny-moe":  # experts split over the ranks: routes, and floors, of its own
            ep = f"{layout}, EP=2"
            want += [("floor", "every GPU its share", ep), ("floor", "interconnect floor", ep)]
            want += [("weightsync", "megatron", ep)]
        else:
            want += [("weightsync", "megatron", layout)]
    assert [(r["kind"], r["name"], r["layout"]) for r in node] == want
    for r in node:
        assert len(r["samples_s"]) == 2 and not r["failed"], r
        if r["kind"] == "weightsync":  # every version of every receiver checked bit for bit
            assert r["bit_exact"] is True and r["transport"] == "shm"
            assert r["x_floor"] > 0  # the megatron row too: held to its layout's floor
    trainer = "megatron-core GPTModel in DDP buffers;"
    assert all(r["note"].startswith(trainer) for r in node if r["name"] == "megatron")
