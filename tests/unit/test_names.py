"""Name rules of the receivers that need no engine: which names an engine without a draft
model may set aside (the MTP layers its config declares, nothing else), and tied aliases.
Where names land in real models (the loader dry run) is tested against the engines
themselves: tests/sweeps, tests/integration/test_vllm_*.py, tests/sglang.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from weightsync.buckets import TensorSpec

H = 8


def test_aliases_are_the_other_names_of_one_tied_tensor():
    from weightsync.receiver.name_resolver import aliases

    model = nn.Module()
    model.embed = nn.Embedding(4, H)
    model.head = nn.Linear(H, 4, bias=False)
    model.other = nn.Linear(H, H)
    model.head.weight = model.embed.weight
    assert aliases(model) == {"embed.weight": ["head.weight"], "head.weight": ["embed.weight"]}
    model.head.weight = nn.Parameter(torch.zeros(4, H))
    assert aliases(model) == {}


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
