"""Issue 35 item 1: connections that never speak, which need no token, must not starve the
sender of descriptors. Started under the common soft limit of 1024, the sender raises it to the
hard limit, and while 1200 mute TCP connections are open a client's Status answers (the sender
also drops a connection that has not finished its handshake after 5 s)."""

from __future__ import annotations

import resource
import socket

import pytest

from tests.support.processes import sender_process
from weightsync.control.client import connect
from weightsync.control.server import FD_LIMIT_CAP
from weightsync.v1 import weightsync_pb2 as pb

FLOOD = 1200
SOFT = 1024


def _open_files_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    return int(line.split()[3])


def test_a_flood_of_mute_connections_leaves_the_sender_descriptors_for_its_clients():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2 * FLOOD:
        pytest.skip(f"this machine's hard descriptor limit ({hard}) is below the flood")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    proc = sender_process(
        address,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, hard)),
    )
    flood: list[socket.socket] = []
    try:
        assert _open_files_limit(proc.pid) == (
            hard if hard != resource.RLIM_INFINITY else FD_LIMIT_CAP
        )
        flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(FLOOD)]
        channel, stub = connect(address, timeout_s=30)
        with channel:
            assert isinstance(stub.Status(pb.StatusRequest(), timeout=30), pb.StatusReply)
    finally:
        for s in flood:
            s.close()
        proc.kill()
        proc.wait()
