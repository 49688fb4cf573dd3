"""Consoles and tables for command output that is never cut.

On a terminal rich fits a table to the window and wraps cells that do not fit. Piped or
redirected, rich would assume 80 columns and cut; here the width is then unlimited (or
``$COLUMNS`` when set), and every column folds rather than truncates, so no cell loses text.
"""

from __future__ import annotations

import os
import sys
from typing import IO

from rich.console import Console
from rich.table import Table
from rich.text import Text

UNLIMITED = 100_000


def console(file: IO[str] | None = None, stderr: bool = False) -> Console:
    """A console on ``file`` (default stdout, or stderr) whose tables are not cut when piped."""
    stream = file if file is not None else (sys.stderr if stderr else sys.stdout)
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    width = None
    if not tty and not os.environ.get("COLUMNS", "").isdigit():
        width = UNLIMITED
    return Console(file=stream, width=width, soft_wrap=False)


def table(*columns: str, right: tuple[str, ...] = (), **kwargs) -> Table:
    """A table whose cells wrap (fold) instead of being cut; ``right``: right-aligned columns."""
    t = Table(**kwargs)
    for col in columns:
        add_column(t, col, justify="right" if col in right else "left")
    return t


def add_column(t: Table, header: str, **kwargs) -> None:
    kwargs.setdefault("overflow", "fold")
    t.add_column(header, **kwargs)


def add_row(t: Table, *cells: object) -> None:
    """Add a row of plain text: brackets in ids or errors are not taken for rich markup."""
    t.add_row(*(Text(str(c)) for c in cells))
