import os
import secrets

import pytest

from tests.support import socket_dir

# The whole suite runs authenticated: every sender (in-process, the CLI, engines' own) requires
# this token and every client sends it; subprocesses inherit it (docs/security.md).
os.environ.setdefault("WEIGHTSYNC_TOKEN", secrets.token_hex(16))


@pytest.fixture
def sock_dir():
    """A short directory for unix sockets (see ``tests.support.socket_dir``)."""
    with socket_dir() as d:
        yield d


@pytest.fixture
def sender(sock_dir):
    from weightsync.sender.daemon import Sender

    with Sender(
        f"unix:{os.path.join(sock_dir, 's.sock')}", bucket_size_bytes=4096, ack_timeout_s=20
    ) as s:
        yield s
