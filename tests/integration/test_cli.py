"""The console scripts, run as a user would."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.support import TinyNet, sync_in_thread
from weightsync import __version__
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher

BIN = os.path.dirname(sys.executable)


LONG_ID = "engine-7-" + "x" * 90  # wider than 80 columns on its own


def weightsync(*args: str, env: dict | None = None, timeout: float = 60):
    """Run ``weightsync ARGS`` piped (not a terminal), without COLUMNS unless ``env`` sets it."""
    base = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run(
        [f"{BIN}/weightsync", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**base, **(env or {})},
    )


def test_status_prints_receivers_and_versions(sender):
    receiver = TorchReceiver(TinyNet(seed=1), sender.address, receiver_id=LONG_ID)
    t, _ = sync_in_thread(receiver)
    Publisher(sender.address).publish(TinyNet(seed=2).state_dict(), 1, wait=True, timeout_s=30)
    t.finish(30)
    out = weightsync("status", "--address", sender.address)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # the tables are the output: stdout
    # piped without COLUMNS, nothing is cut: the whole id is on one line
    assert LONG_ID in out.stdout and "…" not in out.stdout
    assert "complete" in out.stdout and "1/1" in out.stdout
    # CPU tensors outside shared memory cannot be offered: the publisher packed them.
    assert "packed by" in out.stdout and "publisher" in out.stdout
    # Its stream moved to a lane (same host): the receivers table says so.
    assert " lane " in out.stdout and "gRPC" not in out.stdout

    narrow = weightsync("status", "--address", sender.address, env={"COLUMNS": "60"})
    assert narrow.returncode == 0, narrow.stderr
    assert all(len(line) <= 60 for line in narrow.stdout.splitlines())
    assert "…" not in narrow.stdout  # cells wrap (fold) instead of being cut
    assert narrow.stdout.count("x") >= 90  # every character of the id, folded over lines

    as_json = weightsync("status", "--json", env={"WEIGHTSYNC_ADDRESS": sender.address})
    assert as_json.returncode == 0, as_json.stderr
    reply = json.loads(as_json.stdout)
    [r] = reply["receivers"]
    assert r["receiver_id"] == LONG_ID and r["applied_version"] == 1 and r["connected"] is True
    assert r["lane"] is True  # on the sender's host its stream moved to a lane
    [v] = reply["versions"]
    assert v["version"] == 1 and v["state"] == "complete"
    assert [o["state"] for o in v["receivers"]] == ["applied"]
    assert reply["bucket_size_bytes"] == 4096
    receiver.close()


def test_status_watch_refreshes_until_its_count(sender):
    out = weightsync(
        "status", "--json", "--watch", "0.2", "--count", "3",
        env={"WEIGHTSYNC_ADDRESS": "", "WEIGHTSYNC_LISTEN": sender.address},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3  # one JSON object per refresh
    assert all(json.loads(line)["transport"] == "auto" for line in lines)
    tables = weightsync("status", "--address", sender.address, "--watch", "0.2", "--count", "2")
    assert tables.returncode == 0, tables.stderr
    assert tables.stdout.count("receivers") == 2 and tables.stdout.count("every 0.2 s") == 2


def test_metrics_bind_this_machine_and_count_connections(sock_dir):
    import urllib.request

    from tests.support import wait_until
    from weightsync.sender.daemon import Sender

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Sender(f"unix:{sock_dir}/m.sock", bucket_size_bytes=4096, metrics_port=port) as sender:
        assert sender.metrics.address == ("127.0.0.1", port)

        def scrape() -> dict[str, float]:
            url = f"http://127.0.0.1:{port}/metrics"
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            return {
                line.split()[0]: float(line.split()[1])
                for line in text.splitlines()
                if line.startswith(("weightsync_receivers_connected", "weightsync_publishers_"))
            }

        assert scrape() == {
            "weightsync_receivers_connected": 0.0,
            "weightsync_publishers_connected": 0.0,
        }
        receiver = TorchReceiver(TinyNet(seed=1), sender.address, receiver_id="r0")
        wait_until(lambda: scrape()["weightsync_receivers_connected"] == 1.0, 10, "gauge")
        receiver.close()
        wait_until(lambda: scrape()["weightsync_receivers_connected"] == 0.0, 10, "gauge")
    with pytest.raises(OSError):  # closed with the sender
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_sender_logs_json_one_object_per_line(sock_dir):
    from tests.support import wait_until

    address = f"unix:{sock_dir}/j.sock"
    proc = subprocess.Popen(
        [f"{BIN}/weightsync-sender", "--listen", address, "--log-format", "json"],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "WEIGHTSYNC_BUCKET_SIZE_BYTES": "4096"},
    )
    try:
        wait_until(lambda: os.path.exists(f"{sock_dir}/j.sock"), 60, "sender socket")
        receiver = TorchReceiver(TinyNet(seed=1), address, receiver_id="r0")
        receiver.close()
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in err.splitlines()]  # every line is one object
    assert records, err
    for r in records:
        assert {"time", "level", "logger", "message"} <= set(r)
    assert "listening on " + address in records[0]["message"]


def test_the_sender_freezes_its_startup_objects_out_of_the_collectors_walks(sock_dir):
    """A full collection of a daemon that imported torch walks ~190k objects (90 ms here);
    frozen once started, later ones skip them (weightsync.gc_pause.freeze_startup)."""
    from tests.support import wait_until

    address = f"unix:{sock_dir}/f.sock"
    args = ["--listen", address, "--log-format", "json", "--log-level", "debug"]
    proc = subprocess.Popen(
        [f"{BIN}/weightsync-sender", *args],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: os.path.exists(f"{sock_dir}/f.sock"), 60, "sender socket")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    froze = [
        m for r in map(json.loads, err.splitlines())
        if (m := re.fullmatch(r"froze (\d+) startup objects .*", r["message"]))
    ]  # fmt: skip
    assert len(froze) == 1, err
    assert int(froze[0][1]) > 50_000


_TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)


@pytest.mark.skipif(
    _TGKILL is None, reason="tgkill's syscall number is known here for x86_64 and aarch64"
)
def test_sigterm_stops_the_sender_whichever_thread_the_kernel_gives_it_to(sock_dir):
    """The kernel hands a process's signal to any thread that does not block it; with many
    threads (gRPC's, CUDA's) it is often not the main one, which Python's handler waits for.
    Sent here to a gRPC thread on purpose, as the GPU bench's sender got it (it never
    stopped)."""
    import ctypes

    from tests.support import wait_until

    address = f"unix:{sock_dir}/t.sock"
    proc = subprocess.Popen(
        [f"{BIN}/weightsync-sender", "--listen", address], stderr=subprocess.PIPE
    )
    try:
        wait_until(lambda: os.path.exists(f"{sock_dir}/t.sock"), 60, "sender socket")
        others = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(_TGKILL, proc.pid, others[0], signal.SIGTERM) == 0
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.communicate()


def test_bad_settings_end_the_processes_with_one_line():
    env = {**os.environ, "WEIGHTSYNC_TRANSPORT": "bogus"}
    sender = [f"{BIN}/weightsync-sender", "--listen", "unix:/tmp/ws-never.sock"]
    out = subprocess.run(sender, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    assert out.stderr == (
        "weightsync-sender: error: WEIGHTSYNC_TRANSPORT='bogus' is invalid; expected one of "
        "auto, shm, cuda_ipc, nccl\n"
    )
    out = weightsync("sender", "--bucket-size-mb", "0")
    assert out.returncode == 2
    assert out.stderr == (
        "weightsync sender: error: argument --bucket-size-mb: '0' is invalid; expected a "
        "positive whole number of MiB (default 512) (see weightsync sender --help)\n"
    )


def test_version_everywhere():
    for prog in ("weightsync", "weightsync-sender"):
        out = subprocess.run([f"{BIN}/{prog}", "--version"], capture_output=True, text=True)
        assert (out.returncode, out.stdout) == (0, f"{prog} {__version__}\n")


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


def test_trace_is_not_cut_when_piped(tmp_path):
    long = "y" * 150
    events = [
        {"t_ns": 1_000_000, "thread": "main", "event": "publish", "version": 1},
        {"t_ns": 2_000_000, "thread": "main", "event": "sender.begin", "detail": long},
    ]
    (tmp_path / "sender-1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    out = weightsync("trace", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert f"detail={long}" in out.stdout and "…" not in out.stdout


def test_trace_gaps_shows_only_the_events_that_waited(tmp_path):
    at_ms = {"publish": 1.0, "sender.begin": 1.2, "receiver.start": 6.2, "receiver.committed": 6.5}
    events = [
        {"t_ns": int(ms * 1e6), "thread": "main", "event": name, "version": 1}
        for name, ms in at_ms.items()
    ]
    (tmp_path / "sender-1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    out = weightsync("trace", str(tmp_path), "--gaps", "1")
    assert out.returncode == 0, out.stderr
    rows = [
        [cell.strip() for cell in line.strip("│ ").split("│")]
        for line in out.stdout.splitlines()
        if "version=1" in line
    ]
    # The publish (0 ms after the version's start) and the 0.2-0.3 ms steps are left out; the
    # 5 ms wait is shown with its time from the publish and from the event before it.
    assert rows == [["5.200", "5.000", "sender-1", "main", "receiver.start", "version=1"]]


def test_trace_of_an_empty_folder_says_so(tmp_path):
    out = subprocess.run(
        [f"{BIN}/weightsync", "trace", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1
    assert f"no trace files (*.jsonl) under {tmp_path}" in out.stdout + out.stderr
