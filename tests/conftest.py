import gc
import os
import secrets
import sys

import pytest

from tests.support import socket_dir
from tests.support.groups import xdist_groups

_GPU_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu")
_importorskip = pytest.importorskip


def _must_import(modname, *args, **kwargs):
    """``pytest.importorskip`` that fails instead, outside tests/gpu: the suite's setup installs
    every package its tests import (scripts/setup.sh), so one that does not import is a broken
    install, which a skip would hide. GPU tests skip where their wheels were not carried."""
    caller = sys._getframe(1).f_globals.get("__file__") or ""
    try:
        return _importorskip(modname, *args, **kwargs)
    except pytest.skip.Exception as e:
        if os.path.abspath(caller).startswith(_GPU_TESTS + os.sep):
            raise
        raise ImportError(
            f"{modname} does not import here ({e}); scripts/setup.sh installs it: run it again"
        ) from None


pytest.importorskip = _must_import

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


# --- test modules that share a vLLM server -----------------------------------------------------
#
# Modules marked with one ``xdist_group`` (``tests.support.vllm.ServerConfig.mark``) share one
# ``vllm serve`` of that configuration: they run one after another (here, and on one worker with
# ``-n 2 --dist loadgroup``, scripts/test.sh), the server starts for the first and stops after
# the last.

_VLLM_SERVERS = pytest.StashKey["object"]()


@pytest.fixture(scope="session")
def vllm_servers(request, tmp_path_factory):
    """The shared ``vllm serve`` processes (``tests.support.vllm.SharedServers``)."""
    from tests.support.vllm import SharedServers

    servers = SharedServers(tmp_path_factory)
    request.config.stash[_VLLM_SERVERS] = servers
    try:
        yield servers
    finally:
        del request.config.stash[_VLLM_SERVERS]
        servers.close()


def pytest_collection_modifyitems(config, items):
    """The tests of one ``xdist_group`` run together, where the group's first test was
    collected; every other test keeps its place. On an xdist worker with ``--dist loadgroup``,
    a grouped test's id ends with ``@<group>``, which the scheduler below reads."""
    first: dict[tuple[str, ...], int] = {}
    anchors = []
    for i, item in enumerate(items):
        groups = tuple(sorted(xdist_groups(item)))
        anchors.append(first.setdefault(groups, i) if groups else i)
        if groups and getattr(config.option, "loadgroup", False):
            _suffix_nodeid(item, "@" + "_".join(groups))
    order = sorted(range(len(items)), key=lambda i: (anchors[i], i))
    items[:] = [items[i] for i in order]


def _suffix_nodeid(item, suffix: str) -> None:
    """What pytest-xdist's worker does for ``--dist loadgroup`` (3.8 sets ``item._nodeid``,
    which pytest 9.2 no longer reads: its ids are ``NodeId`` objects in ``item._id``)."""
    if item.nodeid.endswith(suffix):
        return
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(item.nodeid + suffix)
    else:
        item._nodeid = item.nodeid + suffix


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """A shared server stops once the next test to run here is not of its group."""
    try:
        return (yield)
    finally:
        servers = item.config.stash.get(_VLLM_SERVERS, None)
        if servers is not None:
            servers.keep_only(xdist_groups(nextitem) if nextitem is not None else set())


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` as ``--dist loadfile`` (a test module stays on one worker: its
    module-scoped engines and senders start once), except that the modules of one
    ``xdist_group`` go to one worker together. (pytest-xdist's own ``loadgroup`` spreads the
    tests without a group one by one.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            # A grouped test's id ends with "@<group>" (pytest_collection_modifyitems).
            if nodeid.rfind("@") > nodeid.rfind("]"):
                return nodeid.rsplit("@", 1)[1]
            return nodeid.split("::", 1)[0]

    return ModulesAndGroups(config, log)
