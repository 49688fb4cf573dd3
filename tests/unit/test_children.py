"""The tests' child processes (``tests/support/children.py``): forked from a server started
earlier, a child still gets its parent's environment and directory as they are at ``start()``,
as a spawned one does (tests set variables for the children they start)."""

from __future__ import annotations

import os

from tests.support import children


def _report(out) -> None:
    out.put((os.environ.get("WS_CHILD_PROBE"), os.getcwd()))


def test_a_child_gets_the_environment_and_directory_of_its_start(monkeypatch, tmp_path):
    out = children.queue()
    first = children.process(_report, (out,))
    first.start()  # the server (where there is one) is up before the changes below
    assert out.get(timeout=120)[0] is None
    first.join(30)
    monkeypatch.setenv("WS_CHILD_PROBE", "set after the first child")
    monkeypatch.chdir(tmp_path)
    second = children.process(_report, (out,))
    second.start()
    assert out.get(timeout=120) == ("set after the first child", str(tmp_path))
    second.join(30)
    assert (first.exitcode, second.exitcode) == (0, 0)
