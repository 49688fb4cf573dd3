"""The ``xdist_group`` marks of a test: the test modules of one group share a process-wide
resource (a ``vllm serve`` of one configuration, ``tests.support.vllm.SharedServers``), and
run one after another on one worker (tests/conftest.py)."""

from __future__ import annotations


def xdist_groups(node) -> set[str]:
    """The names of the ``xdist_group`` marks on ``node`` (a test, or a module), as
    pytest-xdist reads them."""
    return {
        str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        for mark in node.iter_markers("xdist_group")
    }
