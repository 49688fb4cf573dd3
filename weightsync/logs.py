"""Logging setup for weightsync processes (the sender CLI) and for embedders.

``configure_logging(level, fmt)`` installs one handler on the root logger:

- ``text`` (default): one line per record. On a terminal, rich's coloured handler; otherwise
  (journald, a pipe, a file) plain ``time level logger: message`` lines, never wrapped, with
  newlines inside a message (tracebacks) written as ``\\n`` so a record stays one line.
- ``json``: one JSON object per line with ``time`` (UTC, ISO 8601), ``level``, ``logger``,
  ``message``, every structured field passed with ``extra={...}``, and ``exception`` when the
  record carries one.

Unset arguments come from ``WEIGHTSYNC_LOG_LEVEL`` and ``WEIGHTSYNC_LOG_FORMAT``.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from weightsync.config import LogSettings

# Attributes every LogRecord has: anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out.setdefault(key, value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class LineFormatter(logging.Formatter):
    """``time level logger: message``, with any newline escaped: one record, one line."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\r", "\\r").replace("\n", "\\n")


def _is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def configure_logging(
    level: str | int | None = None, fmt: str | None = None, stream: IO[str] | None = None
) -> logging.Handler:
    """Send every record at ``level`` and above to ``stream`` (default stderr) in ``fmt``.

    Args:
        level: debug, info, warning, error or critical (any case), or a ``logging`` level
            number; None: ``$WEIGHTSYNC_LOG_LEVEL``, else info.
        fmt: ``text`` or ``json``; None: ``$WEIGHTSYNC_LOG_FORMAT``, else text.
        stream: where to write; rich's handler is used only for ``text`` on a terminal.

    Returns:
        The handler installed; it replaces the root logger's handlers.

    Raises:
        ConfigError: an unknown level or format (one line naming it and the accepted values).
    """
    given: dict[str, Any] = {}
    if isinstance(level, int) and not isinstance(level, bool):
        number = level
    else:
        if level is not None:
            given["level"] = level
        number = None
    if fmt is not None:
        given["format"] = fmt
    settings = LogSettings(**given)
    if number is None:
        number = logging.getLevelName(settings.level.upper())
    stream = sys.stderr if stream is None else stream
    handler: logging.Handler
    if settings.format == "json":
        handler = logging.StreamHandler(stream)
        handler.setFormatter(JsonFormatter())
    elif _is_tty(stream):
        from rich.console import Console
        from rich.logging import RichHandler

        handler = RichHandler(console=Console(file=stream), show_path=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(LineFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(number)
    return handler


@contextmanager
def quieted(name: str, level: int = logging.WARNING) -> Iterator[None]:
    """Logger ``name`` at ``level`` inside the block (or the decorated call), as it was after."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)
