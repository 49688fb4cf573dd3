"""The bench's engine-like target: HF names resolve to packed and fused-expert slices."""

from __future__ import annotations

import pytest
import torch

from weightsync.app.bench.engine_like import EngineLikeModel, EngineLikeTarget
from weightsync.app.bench.layout import TrainerShards, plan_layout
from weightsync.app.bench.models import hf_specs, model_shape
from weightsync.app.bench.worker import verify
from weightsync.buckets import TensorSpec
from weightsync.errors import ConfigError, ManifestMismatchError, NameResolutionError
from weightsync.manifest import VersionManifest

CPU = torch.device("cpu")


def _hf(model: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    specs = hf_specs(model_shape(model))
    return {s.name: torch.randn(s.shape, generator=g).to(torch.bfloat16) for s in specs}


def test_dense_names_land_in_qkv_and_gate_up_rows_in_order():
    hf = _hf("tiny")
    model = EngineLikeModel(model_shape("tiny"), CPU)
    target = EngineLikeTarget(model)
    target.validate(VersionManifest(1, tuple(TensorSpec.of(n, t) for n, t in hf.items())))
    target.load(list(hf.items()))
    p = "model.layers.1"
    live = model.get_parameter
    qkv = [hf[f"{p}.self_attn.{m}_proj.weight"] for m in "qkv"]
    assert torch.equal(live(f"{p}.self_attn.qkv_proj.weight"), torch.cat(qkv))
    bias = [hf[f"{p}.self_attn.{m}_proj.bias"] for m in "qkv"]
    assert torch.equal(live(f"{p}.self_attn.qkv_proj.bias"), torch.cat(bias))
    gate_up = [hf[f"{p}.mlp.{m}_proj.weight"] for m in ("gate", "up")]
    assert torch.equal(live(f"{p}.mlp.gate_up_proj.weight"), torch.cat(gate_up))
    assert torch.equal(live(f"{p}.mlp.down_proj.weight"), hf[f"{p}.mlp.down_proj.weight"])
    assert torch.equal(live("lm_head.weight"), hf["lm_head.weight"])


def test_expert_names_land_in_fused_w13_and_w2():
    hf = _hf("tiny-moe")
    model = EngineLikeModel(model_shape("tiny-moe"), CPU)
    EngineLikeTarget(model).load(list(hf.items()))
    w13 = model.get_parameter("model.layers.0.mlp.experts.w13_weight")
    w2 = model.get_parameter("model.layers.0.mlp.experts.w2_weight")
    for e in range(4):
        p = f"model.layers.0.mlp.experts.{e}"
        gate_up = torch.cat([hf[f"{p}.gate_proj.weight"], hf[f"{p}.up_proj.weight"]])
        assert torch.equal(w13[e], gate_up)
        assert torch.equal(w2[e], hf[f"{p}.down_proj.weight"])
    router = "model.layers.0.mlp.gate.weight"
    assert torch.equal(model.get_parameter(router), hf[router])


def test_engine_parameters_are_packed_like_vllm():
    names = {n for n, _ in EngineLikeModel(model_shape("tiny-moe"), CPU).named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.experts.w13_weight" in names
    assert not any("q_proj" in n or "gate_proj" in n or ".experts.0." in n for n in names)


def test_unknown_names_and_wrong_shapes_are_rejected_with_the_name():
    target = EngineLikeTarget(EngineLikeModel(model_shape("tiny"), CPU))
    unknown = TensorSpec("model.layers.0.self_attn.rotary.weight", "bfloat16", (4,))
    with pytest.raises(NameResolutionError, match="rotary"):
        target.validate(VersionManifest(1, (unknown,)))
    expert = TensorSpec("model.layers.0.mlp.experts.0.up_proj.weight", "bfloat16", (256, 128))
    with pytest.raises(NameResolutionError, match="w13_weight"):
        target.validate(VersionManifest(1, (expert,)))
    wrong = TensorSpec("model.layers.0.self_attn.k_proj.weight", "bfloat16", (65, 128))
    with pytest.raises(ManifestMismatchError, match="k_proj"):
        target.validate(VersionManifest(1, (wrong,)))
    fp32 = TensorSpec("model.norm.weight", "float32", (128,))
    with pytest.raises(ManifestMismatchError, match="model.norm.weight"):
        target.validate(VersionManifest(1, (fp32,)))


@pytest.mark.parametrize("tp", [1, 2])
def test_verify_finds_a_single_flipped_element(tp):
    shards = TrainerShards.allocate(plan_layout(model_shape("tiny-moe"), tp), CPU, seed=2)
    target = EngineLikeTarget(EngineLikeModel(model_shape("tiny-moe"), CPU))
    assert verify(target, shards)[1] == tuple(r.spec.name for r in shards.layout.recipes)
    target.load([(r.spec.name, shards.assemble(r)) for r in shards.layout.recipes])
    assert verify(target, shards) == (45, ())
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    target.resolve(name)[7, 9].view(torch.int16).bitwise_xor_(1)
    assert verify(target, shards) == (45, (name,))


def _kept(hf: dict[str, torch.Tensor], targets: list[EngineLikeTarget]) -> list[str]:
    """HF names whose ranks' live slices, joined along the shard dim, differ from ``hf``."""
    wrong = []
    for name, full in hf.items():
        shard = targets[0].shard(name, tuple(full.shape))
        parts = [t.resolve(name) for t in targets]
        joined = parts[0] if shard.dim is None else torch.cat(parts, dim=shard.dim)
        replicas_equal = all(torch.equal(p, parts[0]) for p in parts) or shard.dim is not None
        if not (torch.equal(joined, full) and replicas_equal):
            wrong.append(name)
    return wrong


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_engine_tp2_ranks_keep_vllm_shards_that_join_to_every_tensor(model):
    hf = _hf(model)
    shape = model_shape(model)
    targets = [EngineLikeTarget(EngineLikeModel(shape, CPU, tp=2, rank=r)) for r in (0, 1)]
    manifest = VersionManifest(1, tuple(TensorSpec.of(n, t) for n, t in hf.items()))
    for t in targets:
        t.validate(manifest)
        t.load(list(hf.items()))
    assert _kept(hf, targets) == []
    p = "model.layers.0"
    assert targets[1].shard(f"{p}.self_attn.o_proj.weight", (128, 128)).dim == 1
    assert targets[1].shard(f"{p}.input_layernorm.weight", (128,)).dim is None
    o_proj = targets[1].model.get_parameter(f"{p}.self_attn.o_proj.weight")
    assert torch.equal(o_proj, hf[f"{p}.self_attn.o_proj.weight"][:, 64:])


def test_engine_tp2_chunks_through_a_real_sender_land_in_each_ranks_shard(sender):
    """Bucket cap 4 KiB: the embedding, lm_head and down_proj arrive in chunks of whole rows,
    written in place into each rank's rows (dim 0) or columns (row-parallel)."""
    from tests.support import sync_in_thread
    from weightsync.receiver.core import ReceiverCore
    from weightsync.sender import Publisher

    hf = _hf("tiny")
    shape = model_shape("tiny")
    targets = [EngineLikeTarget(EngineLikeModel(shape, CPU, tp=2, rank=r)) for r in (0, 1)]
    receivers = [
        ReceiverCore(t, sender.address, receiver_id=f"tp{r}") for r, t in enumerate(targets)
    ]
    threads = [sync_in_thread(r)[0] for r in receivers]
    with Publisher(sender.address) as publisher:
        publisher.publish(hf, 1, wait=True, timeout_s=60)
    for t in threads:
        t.finish(60)
    for r in receivers:
        r.close()
    assert _kept(hf, targets) == []


def test_engine_tp_that_does_not_split_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="kv_heads 2 does not split"):
        EngineLikeModel(model_shape("tiny"), CPU, tp=4, rank=0)
    target = EngineLikeTarget(EngineLikeModel(model_shape("tiny"), CPU, tp=2, rank=0))
    odd = TensorSpec("model.layers.0.self_attn.q_proj.weight", "bfloat16", (127, 128))
    with pytest.raises(ManifestMismatchError, match="q_proj.*does not split"):
        target.validate(VersionManifest(1, (odd,)))
