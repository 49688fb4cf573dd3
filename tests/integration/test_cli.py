"""The console scripts, run as a user would."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import TinyNet, sync_in_thread
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher

BIN = os.path.dirname(sys.executable)


def test_status_prints_receivers_and_versions(sender):
    receiver = TorchReceiver(TinyNet(seed=1), sender.address, receiver_id="engine-7")
    t, _ = sync_in_thread(receiver)
    Publisher(sender.address).publish(TinyNet(seed=2).state_dict(), 1, wait=True, timeout_s=30)
    t.finish(30)
    out = subprocess.run(
        [f"{BIN}/weightsync", "status", "--address", sender.address],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr
    assert "engine-7" in out.stderr and "complete" in out.stderr and "1/1" in out.stderr
    # CPU tensors outside shared memory cannot be offered: the publisher packed them.
    assert "packed by" in out.stderr and "publisher" in out.stderr


def test_status_against_nothing_fails_clearly(sock_dir):
    out = subprocess.run(
        [
            f"{BIN}/weightsync",
            "status",
            "--address",
            f"unix:{sock_dir}/x.sock",
            "--timeout-s",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "no weightsync sender answers" in out.stderr


def test_sender_help_explains_options():
    out = subprocess.run(
        [f"{BIN}/weightsync-sender", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for opt in ("--listen", "--bucket-size-mb", "--num-buffers", "--transport", "WEIGHTSYNC_"):
        assert opt in out.stdout


def test_demo_ends_with_the_bit_exact_line():
    out = subprocess.run([f"{BIN}/weightsync", "demo"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "demo: 3 versions to 2 receivers, bit-exact: yes"


def test_trace_lines_up_every_process_of_a_version(tmp_path):
    """With WEIGHTSYNC_TRACE_DIR set, the demo's trainer, sender and receiver processes each
    write their events; `weightsync trace` prints one timeline of the version asked for."""
    import os

    env = {**os.environ, "WEIGHTSYNC_TRACE_DIR": str(tmp_path), "COLUMNS": "200"}
    demo = [f"{BIN}/weightsync", "demo", "--versions", "2", "--receivers", "1"]
    out = subprocess.run(demo, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    files = sorted(p.name.split("-")[0] for p in tmp_path.glob("*.jsonl"))
    assert "receiver" in files and len(files) >= 2, files
    trace = [f"{BIN}/weightsync", "trace", str(tmp_path), "--version", "2"]
    shown = subprocess.run(trace, capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0, shown.stderr[-2000:]
    for event in ("publish", "sender.begin", "sender.announce", "receiver.committed"):
        assert event in shown.stdout, event
    assert "version=2" in shown.stdout and "version=1 " not in shown.stdout
    missing = subprocess.run(
        trace[:-1] + ["7"], capture_output=True, text=True, timeout=60, env=env
    )
    assert missing.returncode == 1
    assert "no publish of version 7 traced; traced: [1, 2]" in missing.stderr


def test_trace_of_an_empty_folder_says_so(tmp_path):
    out = subprocess.run(
        [f"{BIN}/weightsync", "trace", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1
    assert f"no trace files (*.jsonl) under {tmp_path}" in out.stdout + out.stderr
