import gc
import os
import secrets
import sys

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


@pytest.fixture(scope="module")
def sender_address():
    """A sender for a module's engine server, started before it (64 KiB buckets; a 120 s ack
    timeout, for engines on two CPU cores). Modules that need other settings define their own."""
    from tests.support import unix_sender

    with unix_sender(bucket_size_bytes=64 * 1024, ack_timeout_s=120) as s:
        yield s.address


@pytest.fixture(autouse=True, scope="module")
def _no_vllm_groups_left():
    """Every test module leaves vLLM's process-wide parallel groups as it found them: none.
    In-process engines make them and tear them down only when collected (or not at all, when
    an engine fails to start), and an engine started on a dense model's leftover groups lacks
    the expert-parallel one an MoE model needs."""
    yield
    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is not None:
        gc.collect()
        state.destroy_model_parallel()
        state.destroy_distributed_environment()
