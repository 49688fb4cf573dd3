from __future__ import annotations

import logging

import pytest


@pytest.fixture
def restore_root_logger():
    """The root logger's handlers and level as they were: a test that configures logging
    (as the CLI does) leaves no handler on another test's streams."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
