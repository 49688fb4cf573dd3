"""Fixtures of the conformance tests: one live sender (the real CLI, in a subprocess) for the
session, stubs generated from the .proto alone, and clients that use nothing else.

The clients (``client.py``, ``node/client.js``) run in their own processes with only the
generated stubs on their path (the Python one refuses to import ``weightsync`` or torch), so
what they do is what docs/protocol.md and the .proto say, not what our code happens to do.
"""

import contextlib
import glob
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conformance.support import SPLIT_SENDERS, WIDE_BUCKET_BYTES, NodeReceivers
from tests.support.conformance import (
    BUCKET_SIZE_BYTES,
    NODE_DIR,
    PROTO,
    Clients,
    SenderProcess,
    clean_env,
    token_env,
)
from tests.support.waiting import wait_until


@pytest.fixture(scope="session")
def stubs(tmp_path_factory) -> Path:
    """Python stubs generated from the .proto alone, as a top-level ``weightsync_pb2``."""
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        pytest.fail("grpcio-tools (the dev extra) is needed: it generates the clients' stubs")
    out = tmp_path_factory.mktemp("stubs")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO.parent}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(PROTO),
        ],
        check=True,
    )
    return out


def _sender_command(address: str) -> list[str]:
    """The installed console script; the CLI function where no script is installed."""
    script = Path(sys.executable).parent / "weightsync-sender"
    if script.exists():
        return [str(script), "--listen", address]
    code = "import sys; from weightsync.app.cli import sender_main; sys.exit(sender_main())"
    return [sys.executable, "-c", code, "--listen", address]


@contextlib.contextmanager
def running_sender(settings: dict[str, str] | None = None) -> Iterator[SenderProcess]:
    """``weightsync-sender --listen unix:...`` (4 KiB buckets unless ``settings``, its
    ``WEIGHTSYNC_*`` environment, say otherwise) until the block ends; then it must have removed
    its staging buffers."""
    d = Path(tempfile.mkdtemp(prefix="wsc-", dir="/tmp"))  # unix socket paths are short
    address = f"unix:{d}/s.sock"
    log = d / "sender.log"
    env = clean_env() | {
        **token_env(),  # the clients send it too
        "WEIGHTSYNC_BUCKET_SIZE_BYTES": str(BUCKET_SIZE_BYTES),
        "WEIGHTSYNC_ACK_TIMEOUT_S": "20",
        "PYTHONUNBUFFERED": "1",
        **(settings or {}),
    }
    with open(log, "w") as out:
        proc = subprocess.Popen(
            _sender_command(address), env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:

        def listening() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the sender exited:\n{log.read_text()[-4000:]}")
            return (d / "s.sock").exists()

        wait_until(listening, 90, f"the sender to listen (its log: {log})")
        yield SenderProcess(address, proc, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        # Staging segments are /dev/shm/weightsync-<owner key>-<pid>-<12 hex> (protocol §6.1).
        leftovers = glob.glob(f"/dev/shm/weightsync-*-{proc.pid}-*")
        shutil.rmtree(d, ignore_errors=True)
        assert not leftovers, f"the sender left its staging buffers behind: {leftovers}"


@pytest.fixture(scope="session")
def sender() -> Iterator[SenderProcess]:
    """The session's sender, 4 KiB buckets."""
    with running_sender() as s:
        yield s


@pytest.fixture(scope="session")
def wide_sender() -> Iterator[SenderProcess]:
    """A sender with 64 KiB buckets, for rows wider than a bucket (protocol §3.1)."""
    with running_sender({"WEIGHTSYNC_BUCKET_SIZE_BYTES": str(WIDE_BUCKET_BYTES)}) as s:
        yield s


@pytest.fixture(scope="session")
def split_senders() -> Iterator[tuple[SenderProcess, SenderProcess]]:
    """Two senders, as on two trainer hosts ("trainer-a", "trainer-b"), for versions split
    over both (protocol §4.1). Receivers on this host send an empty host_id to both."""
    with (
        running_sender({"WEIGHTSYNC_HOST_ID": SPLIT_SENDERS[0]}) as a,
        running_sender({"WEIGHTSYNC_HOST_ID": SPLIT_SENDERS[1]}) as b,
    ):
        yield a, b


@pytest.fixture
def clients(stubs, sender) -> Iterator[Clients]:
    c = Clients(stubs, sender.address)
    try:
        yield c
    finally:
        c.kill_all()


# ---- node -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def node_modules() -> Path:
    """``npm ci`` of node/package-lock.json, once per lock file, in the user's cache."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail("node and npm are needed for the Node client: install them (Node >= 18)")
    lock = (NODE_DIR / "package-lock.json").read_bytes()
    key = hashlib.sha256(lock + (NODE_DIR / "package.json").read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "weightsync"
    final = cache / f"node-{key}"
    if not (final / "node_modules" / "@grpc" / "grpc-js").exists():
        cache.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f"node-{key}-", dir=cache))
        for name in ("package.json", "package-lock.json"):
            shutil.copy(NODE_DIR / name, work / name)
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            shutil.rmtree(work, ignore_errors=True)
            raise AssertionError(f"npm ci failed in {work}:\n{done.stderr[-4000:]}")
        work.chmod(0o755)
        try:
            work.rename(final)  # atomic: a concurrent run may have won, which is as good
        except OSError:
            shutil.rmtree(work, ignore_errors=True)
    return final / "node_modules"


@pytest.fixture
def node_clients(node_modules, sender) -> Iterator[NodeReceivers]:
    c = NodeReceivers(node_modules, sender.address)
    try:
        yield c
    finally:
        c.kill_all()
