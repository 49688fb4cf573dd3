"""``weightsync wait``, run as a user would, against a real sender."""

from __future__ import annotations

import json
import subprocess
import time

from tests.integration.test_cli import BIN, weightsync
from tests.support import TinyNet, sync_in_thread
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher


def test_wait_started_before_the_publish_gets_that_versions_status(sender):
    waiter = subprocess.Popen(
        [f"{BIN}/weightsync", "wait", "1", "--address", sender.address, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(3)  # the waiter is connected and waiting for a version not yet published
    assert waiter.poll() is None
    receiver = TorchReceiver(TinyNet(seed=1), sender.address, receiver_id="r0")
    try:
        t, _ = sync_in_thread(receiver)
        Publisher(sender.address).publish(TinyNet(seed=2).state_dict(), 1, timeout_s=30)
        t.finish(30)
        out, err = waiter.communicate(timeout=60)
        assert waiter.returncode == 0, err
        status = json.loads(out)
        assert status["version"] == 1 and status["state"] == "complete"
        assert [(o["receiver_id"], o["state"]) for o in status["receivers"]] == [("r0", "applied")]

        table = weightsync("wait", "1", "--address", sender.address)  # already done: at once
        assert table.returncode == 0, table.stderr
        assert "version 1: complete" in table.stdout and "r0" in table.stdout
    finally:
        receiver.close()


def test_wait_past_its_timeout_or_for_a_bad_version_ends_with_one_line(sender):
    out = weightsync("wait", "5", "--address", sender.address, "--timeout-s", "0.5")
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr.startswith("weightsync: error: wait for version 5 at ")
    assert out.stderr.endswith(
        ": version 5 was not published within 0.5 s (the last published version is 0)\n"
    )
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    bad = weightsync("wait", "0", "--address", sender.address)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "argument version: '0' is invalid" in bad.stderr
