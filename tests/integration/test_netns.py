"""A receiver on another "host": its own network namespace, reached over a veth pair.

Needs root and iproute2 (CI runs as root); skipped otherwise. Traffic stays between the two
namespaces this test creates.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from tests.support import TinyNet, digests, step
from weightsync.sender import Publisher
from weightsync.sender.daemon import Sender

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"
)

RECEIVER = """
import sys, torch
from tests.support import TinyNet, digests
from weightsync.receiver import TorchReceiver
model = TinyNet(seed=7)
receiver = TorchReceiver(model, sys.argv[1], receiver_id="far")
print("ready", flush=True)
for _ in range(2):
    v = receiver.sync(timeout=60)
    print(v, sorted(digests(model).items()), flush=True)
"""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def far_host():
    tag = uuid.uuid4().hex[:6]
    ns, host_if, far_if = f"ws-{tag}", f"wsh{tag}", f"wsf{tag}"
    subnet = f"10.213.{int(tag[:2], 16)}"
    ip("netns", "add", ns)
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", far_if)
        ip("link", "set", far_if, "netns", ns)
        ip("addr", "add", f"{subnet}.1/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{subnet}.2/30", "dev", far_if)
        ip("netns", "exec", ns, "ip", "link", "set", far_if, "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, f"{subnet}.1"
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_receiver_in_another_network_namespace_gets_broadcasts(far_host):
    ns, host_ip = far_host
    with Sender(f"{host_ip}:0", broadcast_host=host_ip, bucket_size_bytes=4096) as sender:
        env = {**os.environ, "WEIGHTSYNC_HOST_ID": "far-host", "PYTHONPATH": os.getcwd()}
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", RECEIVER, sender.address],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
            trainer = TinyNet(seed=1)
            publisher = Publisher(sender.address)
            for version in (1, 2):
                step(trainer, version)
                publisher.publish(trainer.state_dict(), version, wait=True, timeout_s=60)
                line = proc.stdout.readline().strip()
                if not line:
                    proc.kill()
                    pytest.fail(f"the receiver died: {proc.stderr.read()[-3000:]}")
                assert line == f"{version} {sorted(digests(trainer).items())}"
            (status,) = publisher.status().receivers
            assert (status.data_path, status.applied_version) == ("broadcast", 2)
        finally:
            proc.kill()
            proc.wait(10)
