"""SglangHttpClient against a local HTTP server that records requests.

SGLang's HTTP server is not run here (the offline ``sglang.Engine`` is, in
tests/sglang/test_engine_hook.py, driven through the Engine's methods of the same names), so
this checks the exact request sequence and the failure handling against a stand-in that
answers like SGLang 0.5.23's routes (status 400 with {"success": false, "message"} or plain
text on failure), with a real sender and receiver where the sender's verdict matters. Runs in
the main venv; SGLang is not imported.
"""

from __future__ import annotations

import base64
import pickle
import socket

import pytest
import torch

from tests.support import TinyNet, digests, sync_in_thread
from tests.support.sglang import UPDATE_ROUTES, FakeSglang
from weightsync.drivers.sglang import (
    PauseMode,
    SglangHttpClient,
    SglangUpdateError,
    publish_to_sglang,
)
from weightsync.errors import ConfigError, ReceiverFailedError
from weightsync.receiver import TorchReceiver
from weightsync.receiver.sglang.hook import HOOK_PATH
from weightsync.sender import Publisher, Sender

KV = {"tags": ["kv_cache"]}
EMPTY = base64.b64encode(pickle.dumps([])).decode()


@pytest.fixture
def sglang():
    with FakeSglang() as fake:
        yield fake


def update_body(tp_size: int) -> dict:
    return {
        "serialized_named_tensors": [EMPTY] * tp_size,
        "load_format": HOOK_PATH,
        "flush_cache": False,
        "selector": "target",
    }


def test_full_sequence_with_pause_and_kv_release(sglang):
    SglangHttpClient(sglang.url, tp_size=2, pause=PauseMode.WAIT, release_kv_cache=True).update(7)
    assert sglang.requests == [
        ("/pause_generation", {"mode": "retract"}),
        ("/release_memory_occupation", KV),
        ("/begin_weight_update", {"selector": "target"}),
        ("/update_weights_from_tensor", update_body(2)),
        ("/end_weight_update", {}),
        ("/resume_memory_occupation", KV),
        ("/flush_cache", {}),
        ("/update_weight_version", {"new_version": "7", "abort_all_requests": False}),
        ("/continue_generation", {}),
    ]


def test_payload_is_an_empty_list_per_rank(sglang):
    SglangHttpClient(sglang.url, tp_size=3, pause=None).update(1)
    payloads = dict(sglang.requests)["/update_weights_from_tensor"]["serialized_named_tensors"]
    assert [pickle.loads(base64.b64decode(p)) for p in payloads] == [[], [], []]


@pytest.mark.parametrize("mode", list(PauseMode))
def test_pause_modes_without_release(sglang, mode):
    SglangHttpClient(sglang.url, pause=mode).update(2)
    assert sglang.requests[0] == ("/pause_generation", {"mode": mode.value})
    # SGLang refuses to flush while requests run, and KEEP leaves them in the running batch.
    routes = [r for r in UPDATE_ROUTES if not (mode is PauseMode.KEEP and r == "/flush_cache")]
    assert sglang.routes() == routes


def test_no_pause(sglang):
    SglangHttpClient(sglang.url, pause=None).update(3)
    assert sglang.routes() == [
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/end_weight_update",
        "/flush_cache",
        "/update_weight_version",
    ]


@pytest.mark.parametrize(
    "failing, step, undone",
    [
        ("/pause_generation", "pause_generation", []),
        ("/release_memory_occupation", "release_kv_cache", ["/continue_generation"]),
        (
            "/begin_weight_update",
            "begin_weight_update",
            ["/resume_memory_occupation", "/continue_generation"],
        ),
    ],
)
def test_failure_before_update_restores_serving_old_weights(sglang, failing, step, undone):
    sglang.fail[failing] = "boom"
    client = SglangHttpClient(sglang.url, pause=PauseMode.ABORT, release_kv_cache=True)
    with pytest.raises(SglangUpdateError, match="previous weights") as info:
        client.update(4)
    assert (info.value.step, info.value.weights_changed) == (step, False)
    assert "boom" in str(info.value)
    done = sglang.routes()
    assert done[done.index(failing) + 1 :] == undone
    assert "/update_weights_from_tensor" not in done


def test_failed_update_closes_session_but_stays_paused(sglang):
    sglang.fail["/update_weights_from_tensor"] = "NameResolutionError: 'model.x.weight'"
    client = SglangHttpClient(sglang.url, pause=PauseMode.WAIT, release_kv_cache=True)
    with pytest.raises(SglangUpdateError, match="model.x.weight") as info:
        client.update(5)
    assert (info.value.step, info.value.weights_changed) == ("update_weights", True)
    routes = sglang.routes()
    assert routes[routes.index("/update_weights_from_tensor") + 1 :] == [
        "/end_weight_update",
        "/resume_memory_occupation",
    ]


@pytest.mark.parametrize(
    "failing, step",
    [
        ("/end_weight_update", "end_weight_update"),
        ("/flush_cache", "flush_cache"),
        ("/update_weight_version", "set_weight_version"),
        ("/continue_generation", "continue_generation"),
    ],
)
def test_failure_after_update_names_step_and_stops(sglang, failing, step):
    sglang.fail[failing] = "nope"
    with pytest.raises(SglangUpdateError, match="NEW weights") as info:
        SglangHttpClient(sglang.url, pause=PauseMode.WAIT).update(6)
    assert (info.value.step, info.value.weights_changed) == (step, True)
    assert sglang.routes()[-1] == failing  # nothing after it: generation is not resumed


def test_success_false_with_status_200_is_a_failure(sglang):
    sglang.soft_fail["/update_weight_version"] = "version rejected"
    with pytest.raises(SglangUpdateError, match="version rejected") as info:
        SglangHttpClient(sglang.url, pause=None).update(1)
    assert info.value.step == "set_weight_version"


def test_unreachable_server_names_the_first_step():
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SglangUpdateError, match="pause_generation.*unreachable") as info:
        SglangHttpClient(f"http://127.0.0.1:{port}", timeout_s=5).update(1)
    assert not info.value.weights_changed


def test_release_kv_needs_an_idle_engine():
    with pytest.raises(ConfigError, match="release_kv_cache"):
        SglangHttpClient("http://x", pause=PauseMode.KEEP, release_kv_cache=True)
    with pytest.raises(ConfigError, match="release_kv_cache"):
        SglangHttpClient("http://x", pause=None, release_kv_cache=True)


def test_a_version_the_sender_reports_failed_is_not_labelled_and_serving_resumes(sglang):
    """The hook answers success for a version its workers refused without writing (SGLang
    would exit on an exception): the sender's verdict decides, before anything is labelled."""

    def refused() -> None:
        raise ReceiverFailedError("receiver sglang-0 failed: no tensor for 'model.x.weight'")

    client = SglangHttpClient(sglang.url, pause=PauseMode.WAIT, release_kv_cache=True)
    with pytest.raises(SglangUpdateError, match="model.x.weight") as info:
        client.update(8, applied=refused)
    assert (info.value.step, info.value.weights_changed) == ("update_weights", False)
    routes = sglang.routes()
    assert routes[routes.index("/update_weights_from_tensor") + 1 :] == [
        "/end_weight_update",
        "/resume_memory_occupation",
        "/continue_generation",
    ]


def test_publish_to_sglang_labels_only_what_every_receiver_applied(sglang, sock_dir):
    """A real sender and receiver: the version a receiver rejects is not labelled on the
    server; the next one is, after the receiver applied it."""
    with Sender(f"unix:{sock_dir}/s.sock") as sender:
        model = TinyNet(seed=1)
        receiver = TorchReceiver(model, sender.address)
        client = SglangHttpClient(sglang.url, pause=None)
        trainer = TinyNet(seed=2)
        with Publisher(sender.address) as publisher:
            bad = {**trainer.state_dict(), "model.x.weight": torch.zeros(2)}
            thread, _ = sync_in_thread(receiver)
            with pytest.raises(SglangUpdateError, match="model.x.weight") as info:
                publish_to_sglang(publisher, bad, 1, [client], timeout_s=60)
            assert info.value.weights_changed is False
            thread.finish(60)
            assert "/update_weight_version" not in sglang.routes()
            thread, _ = sync_in_thread(receiver)
            publish_to_sglang(publisher, trainer.state_dict(), 2, [client], timeout_s=60)
            assert thread.finish(60) == [2]
        assert digests(model) == digests(trainer)
        assert sglang.requests[-1] == (
            "/update_weight_version",
            {"new_version": "2", "abort_all_requests": False},
        )
