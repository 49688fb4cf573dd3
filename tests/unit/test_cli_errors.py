"""Every bad setting or argument ends the CLI with exit code 2 and one stderr line naming it and
what it accepts (the console scripts run in-process here; test_cli.py runs them as processes)."""

from __future__ import annotations

import socket

import pytest

from weightsync import __version__
from weightsync.app.cli import main, sender_main

pytestmark = pytest.mark.usefixtures("restore_root_logger")  # they configure logging


def run(entry, argv, capsys) -> tuple[int, str, str]:
    try:
        rc = entry(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(entry, argv, capsys) -> str:
    rc, out, err = run(entry, argv, capsys)
    assert rc == 2, (out, err)
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err.rstrip("\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SIZE = "expected a positive multiple of 256 bytes (default 536870912, 512 MiB)"


@pytest.mark.parametrize(
    "var, value, message",
    [
        (
            "WEIGHTSYNC_BUCKET_SIZE_BYTES",
            "abc",
            f"WEIGHTSYNC_BUCKET_SIZE_BYTES='abc' is invalid; {SIZE}",
        ),
        (
            "WEIGHTSYNC_BUCKET_SIZE_BYTES",
            "1000",
            f"WEIGHTSYNC_BUCKET_SIZE_BYTES='1000' is invalid; {SIZE}",
        ),
        (
            "WEIGHTSYNC_TRANSPORT",
            "bogus",
            "WEIGHTSYNC_TRANSPORT='bogus' is invalid; expected one of auto, shm, cuda_ipc, nccl",
        ),
        (
            "WEIGHTSYNC_LANES",
            "maybe",
            "WEIGHTSYNC_LANES='maybe' is invalid; expected true or false (default true)",
        ),
        (
            "WEIGHTSYNC_ARMED_STARTS",
            "maybe",
            "WEIGHTSYNC_ARMED_STARTS='maybe' is invalid; expected true or false (default true)",
        ),
        (
            "WEIGHTSYNC_LOG_FORMAT",
            "xml",
            "WEIGHTSYNC_LOG_FORMAT='xml' is invalid; expected text (one line per record; rich on "
            "a terminal) or json (one object per line)",
        ),
    ],
)
def test_bad_env_settings(monkeypatch, capsys, sock_dir, var, value, message):
    monkeypatch.setenv(var, value)
    line = one_error_line(sender_main, ["--listen", f"unix:{sock_dir}/s.sock"], capsys)
    assert line == f"weightsync-sender: error: {message}"


ARG = "weightsync-sender: error: argument"
HELP = "(see weightsync-sender --help)"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--num-buffers", "1"],
            f"{ARG} --num-buffers: '1' is invalid; expected an integer >= 2 (default 2) {HELP}",
        ),
        (
            ["--bucket-size-mb", "-5"],
            f"{ARG} --bucket-size-mb: '-5' is invalid; expected a positive whole number of MiB "
            f"(default 512) {HELP}",
        ),
        (
            ["--bucket-size-mb", "0"],  # once silently the default 512 MiB
            f"{ARG} --bucket-size-mb: '0' is invalid; expected a positive whole number of MiB "
            f"(default 512) {HELP}",
        ),
        (
            ["--transport", "bogus"],
            f"{ARG} --transport: invalid choice: 'bogus' (choose from 'auto', 'shm', 'cuda_ipc', "
            f"'nccl') {HELP}",
        ),
        (
            ["--listen", "nonsense"],
            f"{ARG} --listen: address 'nonsense' is neither unix:/abs/path nor host:port "
            f"(e.g. 127.0.0.1:50551) {HELP}",
        ),
        (
            ["--metrics-port", "70000"],
            f"{ARG} --metrics-port: '70000' is invalid; expected a TCP port 0-65535 (0, the "
            f"default: no metrics endpoint) {HELP}",
        ),
        (
            ["--max-streams", "0"],
            f"{ARG} --max-streams: '0' is invalid; expected an integer >= 1 (default 1024) {HELP}",
        ),
        (
            ["--ack-timeout-s", "0"],
            f"{ARG} --ack-timeout-s: '0' is invalid; expected a number of seconds > 0 {HELP}",
        ),
        (
            ["--log-level", "loud"],
            f"{ARG} --log-level: invalid choice: 'loud' (choose from 'debug', 'info', 'warning', "
            f"'error', 'critical') {HELP}",
        ),
    ],
)
def test_bad_sender_arguments(capsys, argv, message):
    assert one_error_line(sender_main, argv, capsys) == message


def test_the_sender_subcommand_says_the_same(capsys):
    line = one_error_line(main, ["sender", "--num-buffers", "1"], capsys)
    assert line == (
        "weightsync sender: error: argument --num-buffers: '1' is invalid; expected an integer "
        ">= 2 (default 2) (see weightsync sender --help)"
    )


def test_listen_in_a_missing_directory(capsys):
    line = one_error_line(sender_main, ["--listen", "unix:/missing/dir/s.sock"], capsys)
    assert line == (
        "weightsync-sender: error: cannot listen on unix:/missing/dir/s.sock: directory "
        "/missing/dir does not exist; create it or pick another address (--listen, "
        "WEIGHTSYNC_LISTEN)"
    )


def test_listen_on_a_busy_port(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_error_line(sender_main, ["--listen", f"127.0.0.1:{port}"], capsys)
    assert line == (
        f"weightsync-sender: error: cannot listen on 127.0.0.1:{port}: address already in use "
        "(is another sender running there?); pick another address (--listen, WEIGHTSYNC_LISTEN)"
    )


def test_a_busy_metrics_port_leaves_nothing_running(capsys, sock_dir):
    path = f"{sock_dir}/s.sock"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["--listen", f"unix:{path}", "--metrics-port", str(port)]
        line = one_error_line(sender_main, argv, capsys)
    assert line == (
        f"weightsync-sender: error: cannot serve metrics on 127.0.0.1:{port}: Address already in "
        "use; pick a free --metrics-port (WEIGHTSYNC_METRICS_PORT) or another --metrics-host "
        "(WEIGHTSYNC_METRICS_HOST)"
    )
    probe = socket.socket(socket.AF_UNIX)
    with pytest.raises(OSError), probe:
        probe.connect(path)  # the control plane did not stay up


def test_status_with_a_bad_argument(capsys):
    line = one_error_line(main, ["status", "--watch", "0"], capsys)
    assert line == (
        "weightsync status: error: argument --watch: '0' is invalid; expected a number of "
        "seconds > 0 (see weightsync status --help)"
    )


def test_status_of_nothing(capsys, sock_dir):
    address = f"unix:{sock_dir}/none.sock"
    line = one_error_line(main, ["status", "--address", address, "--timeout-s", "0.2"], capsys)
    assert line == (
        f"weightsync: error: no weightsync sender answers at {address} within 0.2 s; start one "
        f"with `weightsync-sender --listen {address}` or fix the address"
    )


def test_a_failing_status_rpc_is_one_line(capsys, sock_dir):
    """A server that is healthy but does not answer Status (here: no WeightSync service)."""
    from weightsync.control.server import create_server

    server, bound, _ = create_server(f"unix:{sock_dir}/s.sock", lambda s: None)
    server.start()
    try:
        line = one_error_line(main, ["status", "--address", bound.text], capsys)
    finally:
        server.stop(None)
    assert line.startswith(f"weightsync: error: status of the sender at {bound.text}: ")
    assert "Method not found" in line


def test_status_reads_the_senders_variable(capsys, monkeypatch, sock_dir):
    address = f"unix:{sock_dir}/from-env.sock"
    monkeypatch.setenv("WEIGHTSYNC_LISTEN", address)
    monkeypatch.delenv("WEIGHTSYNC_ADDRESS", raising=False)
    line = one_error_line(main, ["status", "--timeout-s", "0.2"], capsys)
    assert f"no weightsync sender answers at {address} " in line
    monkeypatch.setenv("WEIGHTSYNC_ADDRESS", f"unix:{sock_dir}/explicit.sock")
    line = one_error_line(main, ["status", "--timeout-s", "0.2"], capsys)
    assert f"no weightsync sender answers at unix:{sock_dir}/explicit.sock " in line


@pytest.mark.parametrize("entry, prog", [(main, "weightsync"), (sender_main, "weightsync-sender")])
def test_version(capsys, entry, prog):
    rc, out, err = run(entry, ["--version"], capsys)
    assert (rc, out, err) == (0, f"{prog} {__version__}\n", "")


def test_no_command(capsys):
    line = one_error_line(main, [], capsys)
    assert line == (
        "weightsync: error: the following arguments are required: command (see weightsync --help)"
    )
