import os
import shutil
import tempfile

import pytest


@pytest.fixture
def sock_dir():
    # Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    d = tempfile.mkdtemp(prefix="ws-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sender(sock_dir):
    from weightsync.sender.daemon import Sender

    with Sender(
        f"unix:{os.path.join(sock_dir, 's.sock')}", bucket_size_bytes=4096, ack_timeout_s=20
    ) as s:
        yield s
