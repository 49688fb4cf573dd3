"""``weightsync plan`` as users run it (a real process): the Kimi-K2 numbers docs/scale.md
quotes, small clusters from an HF config.json, and one-line errors naming the field."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from weightsync.app.plan_cli import DELTA_ENCODE_GB_S

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "scale.md"
SUMMARY = ("busiest NIC:", "predicted:", "floor:", "ratio:", "as built:")


def plan(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weightsync.app.cli", "plan", *args],
        cwd=cwd, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def summary(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith(SUMMARY)]


def test_the_kimi_k2_plan_is_the_one_docs_scale_md_quotes():
    doc = DOC.read_text()
    command = "weightsync plan --topology deploy/topologies/kimi-k2.yaml"
    assert command in doc
    quoted = summary(doc.split(command, 1)[1].split("```", 1)[0])
    assert [q.split(":")[0] for q in quoted] == [s.rstrip(":") for s in SUMMARY]
    done = plan("--topology", "deploy/topologies/kimi-k2.yaml")
    assert done.returncode == 0, done.stderr
    assert summary(done.stdout) == quoted
    predicted = float(re.search(r"predicted: ([\d.]+) s", done.stdout)[1])
    ratio = float(re.search(r"ratio: ([\d.]+)x", done.stdout)[1])
    assert predicted < 1.3 and ratio <= 1.3  # the goal


TINY = {
    "model_type": "qwen3", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 384,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
}  # fmt: skip


def write(tmp_path: Path, topo: dict, name: str = "topo.json") -> Path:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY))
    path = tmp_path / name
    path.write_text(json.dumps(topo))
    return path


GOOD = {
    "model": {"config": "model/config.json"},
    "trainer": {"hosts": 2, "gpus_per_host": 2, "tp": 2},
    "engines": {"replicas": 2, "tp": 2, "gpus_per_host": 2},
    "links": {"nic_gb_s": 1e-6},  # 1 kB/s: the sizes below are exact in the printed seconds
    "transfer": "p2p",
}


def test_a_cluster_from_a_config_json_prints_bytes_per_link_and_the_floor(tmp_path):
    done = plan("--topology", str(write(tmp_path, GOOD)))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    # Every engine rank takes half of the model (its TP shard) plus the norms, over a NIC.
    for column in ("link class", "nic_in", "nic_out", "host_out"):
        assert column in out
    assert "local 0.00 GB, peer 0.00 GB, remote" in out
    assert re.search(r"predicted: [\d.]+ s, bound by nic_", out)
    assert "ratio: 1.00x the floor" in out


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engines": {**GOOD["engines"], "tp": 0}},
         "engines.tp=0: Input should be greater than or equal to 1"),
        ({"engines": {**GOOD["engines"], "dtype": "int4"}},
         "engines.dtype='int4': Input should be 'bf16' or 'fp8'"),
        ({"trainer": {**GOOD["trainer"], "tpp": 2}}, "trainer.tpp: unknown field"),
        ({"trainer": {"hosts": 2}}, "trainer.gpus_per_host: missing"),
        ({"trainer": {**GOOD["trainer"], "tp": 4, "hosts": 1, "gpus_per_host": 4,
                      "dp": 2}}, "trainer: Value error, dp=2, but"),
        ({"model": {"preset": "gpt-5"}}, "model.preset='gpt-5' is unknown; known: kimi-k2"),
        ({"model": {"config": "nowhere.json"}}, "model.config"),
    ],
)  # fmt: skip
def test_a_bad_topology_file_is_one_line_naming_the_field(tmp_path, change, message):
    done = plan("--topology", str(write(tmp_path, {**GOOD, **change})))
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("weightsync: error: topology file ")
    assert message.replace("Value error, ", "") in done.stderr


def test_yaml_files_and_unreadable_ones(tmp_path):
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed: YAML topologies need it")
    path = write(tmp_path, {}, "topo.yaml")
    path.write_text(yaml.safe_dump(GOOD))
    assert plan("--topology", str(path)).returncode == 0
    path.write_text("trainer: [unclosed")
    done = plan("--topology", str(path))
    assert done.returncode == 2 and "not YAML" in done.stderr
    done = plan("--topology", str(tmp_path / "missing.yaml"))
    assert done.returncode == 2 and "No such file or directory" in done.stderr


def test_help_explains_every_field():
    done = plan("--help")
    assert done.returncode == 0
    for field in ("preset", "gpus_per_host", "expert_tp", "pp_layers", "replicas", "dtype",
                  "nic_gb_s", "nvlink_gb_s", "host_nic_gb_s", "transfer", "floor"):  # fmt: skip
        assert field in done.stdout


def test_a_delta_ratio_scales_the_times_of_the_same_plan(tmp_path):
    """Every time the plan prints is bytes over a link's rate: deltas of R times the bytes
    take R times each on the wire, while each sender still encodes every byte of its part (the
    busiest bounds the version where it is slower than the wire); an FP8 engine's bytes are
    planned by ``engines.dtype``."""
    path = str(write(tmp_path, {**GOOD, "engines": {**GOOD["engines"], "dtype": "fp8"}}))
    full, deltas = plan("--topology", path), plan("--topology", path, "--delta-ratio", "0.25")
    assert full.returncode == deltas.returncode == 0, deltas.stderr
    assert deltas.stdout.startswith(full.stdout)
    seconds = {
        key: float(re.search(rf"{key}:? ([\d.]+) s", full.stdout)[1])
        for key in ("predicted", "floor")
    }
    seconds["as built"] = float(re.search(r"as built: .*: ([\d.]+) s", full.stdout)[1])
    line = deltas.stdout[len(full.stdout) :].strip()
    wire = seconds["as built"] * 0.25
    assert line.startswith(
        f"with deltas of 0.25x the bytes: on the wire predicted {seconds['predicted'] * 0.25:.3f}"
        f" s, floor {seconds['floor'] * 0.25:.3f} s, as built {wire:.3f} s; encoding them, "
    )
    assert line.endswith("(a receiver that missed a version, or joined late, takes the full bytes)")
    # Encoding at the default rate is nothing beside this test's 1 kB/s links: the wire bounds it.
    assert re.search(rf"at {DELTA_ENCODE_GB_S:g} GB/s on trainer-\d: 0\.000 s", line)
    assert f"a version as built about {wire:.3f} s, bound by the wire" in line
    # Encoding at the NIC's rate takes what the busiest sender's full bytes take on its NIC
    # (that sender bounds the full version as built): the version is no faster than in full.
    same = plan("--topology", path, "--delta-ratio", "0.25", "--delta-encode-gb-s", "1e-6")
    assert "bound by trainer host" in full.stdout
    assert f"a version as built about {seconds['as built']:.3f} s, bound by the senders' " in (
        same.stdout
    )
    wrong = plan("--topology", path, "--delta-ratio", "1.5")
    assert wrong.returncode == 2 and "--delta-ratio 1.5: a delta is 0 < R <= 1" in wrong.stderr
    zero = plan("--topology", path, "--delta-ratio", "0.5", "--delta-encode-gb-s", "0")
    assert zero.returncode == 2 and "--delta-encode-gb-s 0: a rate is > 0" in zero.stderr
    alone = plan("--topology", path, "--delta-encode-gb-s", "10")
    assert alone.returncode == 2 and "give --delta-ratio" in alone.stderr
