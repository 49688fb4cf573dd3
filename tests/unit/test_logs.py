"""``weightsync.logs.configure_logging``: one record, one line, in text or JSON."""

from __future__ import annotations

import io
import json
import logging

import pytest

from weightsync.errors import ConfigError
from weightsync.logs import configure_logging

pytestmark = pytest.mark.usefixtures("restore_root_logger")  # they configure logging


def test_json_is_one_object_per_line_with_the_structured_fields():
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    log = logging.getLogger("weightsync.sender")
    log.info("receiver %s joined", "engine-0", extra={"receiver": "engine-0", "rank": 3})
    log.debug("not shown at info")
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        log.exception("version 2 failed")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    # Fields set on every record by a record factory (vLLM adds its process name once
    # imported in this process) come through too; ours must all be there.
    assert {"time", "level", "logger", "message", "receiver", "rank"} <= set(first)
    assert first["level"] == "INFO" and first["logger"] == "weightsync.sender"
    assert first["message"] == "receiver engine-0 joined"
    assert first["receiver"] == "engine-0" and first["rank"] == 3
    assert first["time"].endswith("Z") and "T" in first["time"]
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exception"]


def test_text_off_a_terminal_is_one_plain_line_per_record():
    out = io.StringIO()  # not a tty: no rich, no wrapping
    configure_logging("debug", "text", stream=out)
    log = logging.getLogger("weightsync.test")
    log.debug("a " + "long " * 60 + "message")
    log.warning("two\nlines")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].split(" ", 2)[2].startswith("DEBUG weightsync.test: a long long")
    assert lines[1].endswith("WARNING weightsync.test: two\\nlines")


def test_level_and_format_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("WEIGHTSYNC_LOG_FORMAT", "json")
    out = io.StringIO()
    configure_logging(stream=out)
    logging.getLogger("x").info("hidden")
    logging.getLogger("x").warning("shown")
    assert [json.loads(line)["message"] for line in out.getvalue().splitlines()] == ["shown"]


def test_arguments_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_LOG_FORMAT", "json")
    out = io.StringIO()
    configure_logging(logging.INFO, "text", stream=out)
    logging.getLogger("x").info("plain")
    assert out.getvalue().rstrip().endswith("INFO x: plain")


def test_bad_values_are_one_line_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match=r"^level='loud' is invalid; expected one of debug, "):
        configure_logging("loud", "text")
    monkeypatch.setenv("WEIGHTSYNC_LOG_LEVEL", "loud")
    with pytest.raises(ConfigError, match=r"^WEIGHTSYNC_LOG_LEVEL='loud' is invalid"):
        configure_logging()


def test_configuring_again_replaces_the_handler():
    first, second = io.StringIO(), io.StringIO()
    configure_logging("info", "text", stream=first)
    configure_logging("info", "json", stream=second)
    logging.getLogger("x").info("once")
    assert first.getvalue() == "" and len(second.getvalue().splitlines()) == 1


def test_quieted_restores_the_level_after_the_call_even_when_it_raises():
    from weightsync.logs import quieted

    log = logging.getLogger("weightsync.test.quieted")
    log.setLevel(logging.DEBUG)

    @quieted("weightsync.test.quieted")
    def fails():
        assert log.level == logging.WARNING
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        fails()
    assert log.level == logging.DEBUG
