"""The live-model name resolver on small torch modules shaped like engine models.

These stand-ins expose the same hooks vLLM/SGLang models do (``packed_modules_mapping``, a
name mapper, ``get_expert_mapping``, ``weight_loader`` attributes); the real engines are
covered in tests/integration/test_vllm_*.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from weightsync.buckets import TensorSpec
from weightsync.errors import ManifestMismatchError, NameResolutionError
from weightsync.receiver.name_resolver import NameResolver, ResolvedName, check_specs

H = 8


class QKVLinear(nn.Module):
    """q (8 rows), k (4), v (4) packed on dim 0, with a shard-aware loader."""

    sizes = {"q": 8, "k": 4, "v": 4}

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(16, H))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id):
        offset = {"q": 0, "k": 8, "v": 12}[shard_id]
        param.data.narrow(0, offset, self.sizes[shard_id]).copy_(loaded)


class MergedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(32, H))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id):
        param.data.narrow(0, 16 * shard_id, 16).copy_(loaded)


class Experts(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.w13_weight = nn.Parameter(torch.zeros(n, 8, H))
        self.w2_weight = nn.Parameter(torch.zeros(n, H, 4))
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader
        self.n = n

    def weight_loader(
        self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False
    ):
        rows = {"w1": (0, 4), "w3": (4, 4), "w2": (0, H)}[shard_id]
        param.data[expert_id].narrow(0, *rows).copy_(loaded_weight)
        return True

    def get_expert_mapping(self):
        out = []
        for e in range(self.n):
            out += [
                ("experts.w13_", f"experts.{e}.gate_proj.", e, "w1"),
                ("experts.w2_", f"experts.{e}.down_proj.", e, "w2"),
                ("experts.w13_", f"experts.{e}.up_proj.", e, "w3"),
            ]
        return out


class Layer(nn.Module):
    def __init__(self, lora: bool) -> None:
        super().__init__()
        self.qkv_proj = QKVLinear()
        self.gate_up_proj = MergedLinear()
        if lora:  # LoRA engines wrap linear layers: the weight moves under .base_layer
            wrapper = nn.Module()
            wrapper.base_layer = self.qkv_proj
            self.qkv_proj = wrapper
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(H))
        self.moe = nn.Module()
        self.moe.experts = nn.Module()
        self.moe.experts.routed_experts = Experts()
        self.register_buffer("expert_bias", torch.zeros(2))


class Mapper:
    """A WeightsMapper-like prefix rename (checkpoint ``transformer.`` -> live ``model.``)."""

    def map_name(self, name: str) -> str | None:
        if name.endswith("rotary_emb.inv_freq"):
            return None
        return name.replace("transformer.", "model.", 1)


class TinyEngineModel(nn.Module):
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    hf_to_vllm_mapper = Mapper()

    def __init__(self, lora: bool = False, tied: bool = True) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(32, H)
        self.model.layers = nn.ModuleList([Layer(lora)])
        self.lm_head = nn.Module()
        self.lm_head.weight = (
            self.model.embed_tokens.weight if tied else nn.Parameter(torch.zeros(32, H))
        )


@pytest.mark.parametrize(
    ("lora", "name", "expected"),
    [
        (
            False,
            "transformer.layers.0.qkv_proj.weight",
            ResolvedName("", "model.layers.0.qkv_proj.weight"),
        ),
        (
            False,
            "transformer.layers.0.k_proj.weight",
            ResolvedName("", "model.layers.0.qkv_proj.weight", "k"),
        ),
        (
            True,
            "transformer.layers.0.v_proj.weight",
            ResolvedName("", "model.layers.0.qkv_proj.base_layer.weight", "v"),
        ),
        (
            True,
            "transformer.layers.0.qkv_proj.base_layer.weight",
            ResolvedName("", "model.layers.0.qkv_proj.base_layer.weight"),
        ),
        (
            False,
            "transformer.layers.0.qkv_proj.base_layer.weight",
            ResolvedName("", "model.layers.0.qkv_proj.weight"),
        ),
        (
            False,
            "transformer.layers.0.up_proj.weight",
            ResolvedName("", "model.layers.0.gate_up_proj.weight", 1),
        ),
        (
            False,
            "transformer.layers.0.moe.experts.1.up_proj.weight",
            ResolvedName(
                "",
                "model.layers.0.moe.experts.routed_experts.w13_weight",
                "w3",
                1,
                "experts.1.up_proj.",
            ),
        ),
        (False, "transformer.layers.0.expert_bias", ResolvedName("", "model.layers.0.expert_bias")),
        (False, "lm_head.weight", ResolvedName("", "lm_head.weight")),
    ],
)
def test_resolve(lora, name, expected):
    resolver = NameResolver(TinyEngineModel(lora=lora))
    assert resolver.resolve(name) == ResolvedName(name, *_rest(expected))


def _rest(r: ResolvedName):
    return r.live_name, r.shard_id, r.expert_id, r.expert_weight_name


def test_unknown_and_mapper_dropped_names_are_all_named():
    resolver = NameResolver(TinyEngineModel())
    with pytest.raises(NameResolutionError) as info:
        resolver.resolve_all(
            [
                "transformer.layers.0.norm.weight",
                "transformer.layers.0.bogus.weight",
                "transformer.layers.0.rotary_emb.inv_freq",
            ]
        )
    message = str(info.value)
    assert "'transformer.layers.0.bogus.weight'" in message
    assert "'transformer.layers.0.rotary_emb.inv_freq'" in message
    assert "norm" not in message


def _spec(name, *shape, dtype="float32"):
    return TensorSpec(name, dtype, shape)


def test_check_specs_dry_runs_loaders_without_writing():
    model = TinyEngineModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    specs = [
        _spec("transformer.layers.0.q_proj.weight", 8, H),
        _spec("transformer.layers.0.k_proj.weight", 4, H),
        _spec("transformer.layers.0.gate_proj.weight", 16, H),
        _spec("transformer.layers.0.moe.experts.0.down_proj.weight", H, 4),
        _spec("transformer.embed_tokens.weight", 32, H),
    ]
    resolved = check_specs(NameResolver(model), specs)
    assert resolved["transformer.layers.0.k_proj.weight"].shard_id == "k"
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (_spec("transformer.layers.0.k_proj.weight", 8, H), "k_proj"),
        (_spec("transformer.layers.0.norm.weight", H + 1), "norm"),
        (_spec("transformer.layers.0.moe.experts.0.gate_proj.weight", 5, H), "gate_proj"),
        (_spec("transformer.layers.0.norm.weight", H, dtype="bfloat16"), "bfloat16"),
    ],
)
def test_check_specs_rejects_shape_and_dtype(spec, match):
    with pytest.raises(ManifestMismatchError, match=match):
        check_specs(NameResolver(TinyEngineModel()), [spec])


def test_tied_alias_is_rejected_naming_the_name_to_send():
    with pytest.raises(NameResolutionError, match="model.embed_tokens.weight"):
        check_specs(NameResolver(TinyEngineModel(tied=True)), [_spec("lm_head.weight", 32, H)])
    resolved = check_specs(
        NameResolver(TinyEngineModel(tied=False)), [_spec("lm_head.weight", 32, H)]
    )
    assert resolved["lm_head.weight"].live_name == "lm_head.weight"


def test_two_names_for_one_slice_rejected():
    specs = [
        _spec("transformer.layers.0.k_proj.weight", 4, H),
        _spec("model.layers.0.k_proj.weight", 4, H),
    ]
    with pytest.raises(ManifestMismatchError, match="both load into"):
        check_specs(NameResolver(TinyEngineModel()), specs)


@pytest.mark.parametrize(
    ("config", "name", "held"),
    [
        # DeepSeek-V3 / GLM-4.5: the declared layers just past the last decoder layer
        (
            {"num_hidden_layers": 2, "num_nextn_predict_layers": 1},
            "model.layers.2.enorm.weight",
            True,
        ),
        (
            {"num_hidden_layers": 2, "num_nextn_predict_layers": 1},
            "model.layers.3.enorm.weight",
            False,
        ),
        (
            {"num_hidden_layers": 2, "num_nextn_predict_layers": 2},
            "model.layers.3.enorm.weight",
            True,
        ),
        (
            {"num_hidden_layers": 2, "num_nextn_predict_layers": 1},
            "model.layers.1.mlp.weight",
            False,
        ),
        # Qwen3-Next / Qwen3.5: mtp.*, its layers up to the declared count
        ({"num_hidden_layers": 2, "mtp_num_hidden_layers": 1}, "mtp.fc.weight", True),
        ({"num_hidden_layers": 2, "mtp_num_hidden_layers": 1}, "mtp.layers.0.mlp.weight", True),
        ({"num_hidden_layers": 2, "mtp_num_hidden_layers": 1}, "mtp.layers.1.mlp.weight", False),
        ({"num_hidden_layers": 2, "num_nextn_predict_layers": 1}, "mtp.norm.weight", True),
    ],
)
def test_mtp_layers_are_the_declared_ones_only(config, name, held):
    from types import SimpleNamespace

    from weightsync.receiver.name_resolver import MtpLayers

    mtp = MtpLayers.of(SimpleNamespace(**config))
    assert mtp is not None and mtp.holds(name) is held


@pytest.mark.parametrize(
    "config",
    [
        {"num_hidden_layers": 2},
        {"num_hidden_layers": 2, "num_nextn_predict_layers": 0},
        {"num_hidden_layers": 2, "mtp_num_hidden_layers": None},
    ],
)
def test_a_model_declaring_no_mtp_sets_nothing_aside(config):
    """A layer past the model's last (a trainer with more layers: the wrong model) or an
    ``mtp.*`` name stays unknown, to be refused naming it."""
    from types import SimpleNamespace

    from weightsync.receiver.name_resolver import MtpLayers, mtp_names_left

    mtp = MtpLayers.of(SimpleNamespace(**config))
    assert mtp is None
    specs = [
        TensorSpec(n, "float32", (H,)) for n in ("model.layers.2.norm.weight", "mtp.fc.weight")
    ]
    assert mtp_names_left(specs, set(), mtp) == []
