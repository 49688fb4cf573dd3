import pytest
from pydantic import ValidationError

from weightsync.addresses import parse_address
from weightsync.config import SenderSettings
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
    s = SenderSettings()
    assert s.bucket_size_bytes == 1 << 20 and s.transport == "shm"


def test_settings_reject_bad_values():
    with pytest.raises(ValidationError, match="bucket_size_bytes"):
        SenderSettings(bucket_size_bytes=1000)
    with pytest.raises(ValidationError, match="num_buffers"):
        SenderSettings(num_buffers=1)
    with pytest.raises(ValidationError, match="transport"):
        SenderSettings(transport="carrier-pigeon")
