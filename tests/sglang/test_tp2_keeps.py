"""Issue 11 at TP=2 in SGLang: each rank of SGLang's REAL model classes declares the box of each
checkpoint tensor its loaders keep (``SglangWeightTarget.keeps``), that box is the one
``weightsync.cluster.tp_box`` models (a padded vocabulary included), and the box suffices: a
version whose tensors hold NaN everywhere outside the rank's declared box loads bit-identical
to SGLang's own load of the clean tensors.

Two spawned processes form a gloo TP group of 2 (file rendezvous) and build every arch in turn
(SGLang's imports take most of the time, so the processes are shared); each reports on a queue
and the test asserts here. Nothing runs forward (tests/support/sglang.py says why).
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch

from tests.support.processes import spawn_ranks
from weightsync.cluster import tp_box
from weightsync.model_shapes import model_tensors
from weightsync.topology_model import Box

pytestmark = pytest.mark.sglang

WORLD = 2
BUCKET_BYTES = 64 * 1024  # several buckets per version, some tensors chunked across buckets
SENTINEL = -7.0
"""Every parameter of both copies starts here: one no load writes stays equal."""
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "qwen3": ("qwen3", {}),  # q/k norms (replicated)
    "qwen3_moe": ("qwen3_moe", {}),  # fused experts: w13 / w2 sharded per expert
    # Fewer KV heads than ranks: both ranks keep the one K/V head whole.
    "qwen2_one_kv_head": ("qwen2", {"num_key_value_heads": 1}),
    # A vocabulary SGLang pads (to a multiple of 64) before splitting it.
    "qwen2_odd_vocab": ("qwen2", {"vocab_size": 500}),
}
WAIT_S = 600  # generous: two SGLang imports on a loaded 2-core box


def _box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in zip(box.start, box.stop, strict=True))


def _outside_nan(tensors: dict[str, torch.Tensor], kept: dict[str, Box]) -> dict[str, torch.Tensor]:
    """``tensors`` with every element outside each kept box NaN (whole-kept tensors as they are)."""
    out = dict(tensors)
    for name, box in kept.items():
        masked = torch.full_like(tensors[name], float("nan"))
        masked[_box_slices(box)] = tensors[name][_box_slices(box)]
        out[name] = masked
    return out


def _model(arch: str, fields: dict[str, Any]) -> tuple[torch.nn.Module, torch.nn.Module]:
    from tests.support.sglang import build

    model, hf = build(arch, **fields)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(SENTINEL)
    return model, hf


def _case(arch: str, fields: dict[str, Any]) -> dict[str, Any]:
    from tests.support import drive, manifest_of, random_weights
    from tests.support.sglang import checkpoint_specs, sglang_load
    from tests.sweeps.archs import differing, live_tensors
    from weightsync.receiver.sglang.target import SglangWeightTarget

    model, hf = _model(arch, fields)
    clean = random_weights(checkpoint_specs(hf), seed=11)
    target = SglangWeightTarget(model, "cpu")
    target.validate(manifest_of(1, clean))
    kept = dict(target.keeps())
    masked = _outside_nan(clean, kept)
    drive(target, manifest_of(1, masked), masked, BUCKET_BYTES)
    reference = sglang_load(_model(arch, fields)[0], clean)
    wrong = differing(live_tensors(model).items(), live_tensors(reference).items())
    # The comparison can fail: NaN on the first element of one declared box reaches the model.
    control: list[str] = []
    if kept:
        name, box = next(iter(kept.items()))
        poisoned = {**masked, name: masked[name].clone()}
        poisoned[name][box.start] = float("nan")
        drive(target, manifest_of(2, poisoned), poisoned, BUCKET_BYTES)
        control = differing(live_tensors(model).items(), live_tensors(reference).items())
    return {
        "config": hf.config.to_dict(),
        "shapes": {n: tuple(t.shape) for n, t in clean.items()},
        "kept": kept,
        "wrong": wrong,
        "control": control,
        "nan_elements": sum(int(t.isnan().sum()) for t in masked.values()),
    }


def _rank_main(rank: int, rendezvous: str, out: Any) -> None:
    """One TP rank: every case, reported as ``(rank, {case: result or traceback})``."""
    results: dict[str, Any] = {}
    try:
        from tests.support.sglang import init_sglang

        init_sglang(world_size=WORLD, rank=rank, rendezvous=rendezvous)
        for case, (arch, fields) in CASES.items():
            try:
                results[case] = _case(arch, fields)
            except Exception:  # noqa: BLE001
                results[case] = traceback.format_exc()
    except Exception:  # noqa: BLE001
        results = {case: traceback.format_exc() for case in CASES}
    out.put((rank, results))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict[str, Any]]:
    """Each rank's results by case."""
    rendezvous = os.path.join(tmp_path_factory.mktemp("tp2"), "rendezvous")
    return spawn_ranks(_rank_main, (rendezvous,), WORLD, WAIT_S)


def _result(ranks: dict[int, dict[str, Any]], rank: int, case: str) -> dict[str, Any]:
    result = ranks[rank][case]
    assert not isinstance(result, str), f"rank {rank}, {case}:\n{result}"
    return result


def _expected(result: dict[str, Any], rank: int) -> dict[str, Box]:
    """``tp_box`` of every tensor that rank keeps only in part."""
    tensors = model_tensors(result["config"], dtype="float32")
    by_name = {t.name: t for t in tensors}
    # weightsync's model of the arch names exactly the checkpoint's tensors, shapes included.
    assert {n: t.shape for n, t in by_name.items()} == result["shapes"]
    boxes = {t.name: tp_box(t, rank, WORLD, by_name) for t in tensors}
    return {n: b for n, b in boxes.items() if b.size != result["shapes"][n]}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rank", range(WORLD))
def test_declared_boxes_are_tp_box(ranks, rank, case):
    result = _result(ranks, rank, case)
    # The mechanism engages at TP=2: an empty kept() would declare every tensor whole.
    assert result["kept"], f"rank {rank} declared no partial tensor of {case} at TP={WORLD}"
    assert result["kept"] == _expected(result, rank)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rank", range(WORLD))
def test_the_declared_box_suffices(ranks, rank, case):
    result = _result(ranks, rank, case)
    assert result["nan_elements"] > 0, "the version had nothing outside a declared box"
    assert not result["wrong"], (
        f"rank {rank}, {case}: {len(result['wrong'])} live tensors differ from SGLang's own "
        f"load of the clean tensors, e.g. {result['wrong'][:4]}"
    )
    assert result["control"], "NaN inside a declared box did not reach the model"
