"""``python -m weightsync.app.bench.broadcast_deltas`` on a small shape: every version arrives
bit-exact over the broadcast path, and the versions after the first cross as fewer bytes."""

from __future__ import annotations

import json

from weightsync.app.bench.broadcast_deltas import main


def test_the_bench_sends_deltas_exactly_and_says_so(capsys):
    assert main(["--model", "qwen3-dense-cpu", "--steps", "1", "--bucket-size-mb", "4"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    later = {r["mode"]: r for r in rows if r["version"] == 2}
    assert later["full"]["broadcast_bytes"] >= later["full"]["staged_bytes"]  # padded buckets
    assert later["deltas"]["delta_buckets"] > 0
    assert later["deltas"]["broadcast_bytes"] < later["full"]["broadcast_bytes"] / 4
    assert all(r["bit_exact"] for r in rows)
