import pytest

from weightsync.addresses import parse_address
from weightsync.config import (
    DEFAULT_ADDRESS,
    LogSettings,
    SenderSettings,
    client_address,
)
from weightsync.errors import ConfigError


def test_addresses():
    assert parse_address("unix:/tmp/a.sock").grpc_target == "unix:/tmp/a.sock"
    assert parse_address("unix:///tmp/a.sock").unix_path == "/tmp/a.sock"
    assert parse_address("127.0.0.1:5000").port == 5000
    for bad in ("nothing", "unix:relative.sock", "host:port", "h:99999"):
        with pytest.raises(ConfigError, match="address"):
            parse_address(bad)


def test_settings_from_env(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_SIZE_BYTES", "1048576")
    monkeypatch.setenv("WEIGHTSYNC_TRANSPORT", "shm")
    monkeypatch.setenv("WEIGHTSYNC_METRICS_HOST", "0.0.0.0")
    s = SenderSettings()
    assert s.bucket_size_bytes == 1 << 20 and s.transport == "shm"
    assert s.metrics_host == "0.0.0.0"


def test_metrics_bind_this_machine_only_by_default():
    assert SenderSettings().metrics_host == "127.0.0.1"


def _message(**kwargs) -> str:
    with pytest.raises(ConfigError) as e:
        SenderSettings(**kwargs)
    return str(e.value)


def test_bad_keywords_are_one_line_naming_the_keyword_and_the_accepted_values():
    assert _message(bucket_size_bytes=1000) == (
        "bucket_size_bytes=1000 is invalid; expected a positive multiple of 256 bytes "
        "(default 536870912, 512 MiB)"
    )
    assert (
        _message(num_buffers=1) == "num_buffers=1 is invalid; expected an integer >= 2 (default 2)"
    )
    assert _message(transport="carrier-pigeon") == (
        "transport='carrier-pigeon' is invalid; expected one of auto, shm, cuda_ipc, nccl"
    )
    assert _message(nonsense=3).startswith("unknown setting 'nonsense'; known: listen, ")
    two = _message(num_buffers=0, ack_timeout_s=-1)
    assert "\n" not in two and "num_buffers=0" in two and "ack_timeout_s=-1" in two


@pytest.mark.parametrize(
    "var, value, expected",
    [
        (
            "WEIGHTSYNC_BUCKET_SIZE_BYTES",
            "abc",
            "WEIGHTSYNC_BUCKET_SIZE_BYTES='abc' is invalid; expected a positive multiple of 256 "
            "bytes (default 536870912, 512 MiB)",
        ),
        (
            "WEIGHTSYNC_BUCKET_SIZE_BYTES",
            "1000",
            "WEIGHTSYNC_BUCKET_SIZE_BYTES='1000' is invalid; expected a positive multiple of 256 "
            "bytes (default 536870912, 512 MiB)",
        ),
        (
            "WEIGHTSYNC_TRANSPORT",
            "bogus",
            "WEIGHTSYNC_TRANSPORT='bogus' is invalid; expected one of auto, shm, cuda_ipc, nccl",
        ),
        (
            "WEIGHTSYNC_NUM_BUFFERS",
            "1",
            "WEIGHTSYNC_NUM_BUFFERS='1' is invalid; expected an integer >= 2 (default 2)",
        ),
        (
            "WEIGHTSYNC_METRICS_PORT",
            "70000",
            "WEIGHTSYNC_METRICS_PORT='70000' is invalid; expected a TCP port 0-65535 "
            "(0, the default: no metrics endpoint)",
        ),
    ],
)
def test_bad_env_vars_are_one_line_naming_the_variable(monkeypatch, var, value, expected):
    monkeypatch.setenv(var, value)
    assert _message() == expected


def test_log_settings(monkeypatch):
    assert LogSettings().level == "info" and LogSettings().format == "text"
    monkeypatch.setenv("WEIGHTSYNC_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("WEIGHTSYNC_LOG_FORMAT", "json")
    assert LogSettings().level == "warning" and LogSettings().format == "json"
    monkeypatch.setenv("WEIGHTSYNC_LOG_FORMAT", "xml")
    with pytest.raises(
        ConfigError, match=r"^WEIGHTSYNC_LOG_FORMAT='xml' is invalid; expected text"
    ):
        LogSettings()


def test_client_address_follows_the_senders_variables():
    assert client_address({}) == DEFAULT_ADDRESS
    assert client_address({"WEIGHTSYNC_LISTEN": "unix:/tmp/l.sock"}) == "unix:/tmp/l.sock"
    both = {"WEIGHTSYNC_LISTEN": "unix:/tmp/l.sock", "WEIGHTSYNC_ADDRESS": "unix:/tmp/a.sock"}
    assert client_address(both) == "unix:/tmp/a.sock"
