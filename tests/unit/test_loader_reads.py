"""What a rank keeps of each checkpoint tensor, learned from the views its loaders read.

The module below is a stand-in with loaders written the way vLLM's and SGLang's TP layers
write theirs (narrow the checkpoint tensor to the rank's shard, copy); the real engines' TP=2
loaders are checked in ``tests/integration/test_vllm_tp2_recovery.py``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from weightsync.buckets import TensorSpec
from weightsync.receiver.name_resolver import kept_boxes, resolve_by_loading
from weightsync.receiver.reads import bounding, view_box
from weightsync.topology_model import Box


@pytest.mark.parametrize(
    ("make", "box"),
    [
        (lambda t: t.narrow(0, 2, 3), Box((2, 0, 0), (3, 4, 5))),
        (lambda t: t.narrow(1, 1, 2), Box((0, 1, 0), (6, 2, 5))),
        (lambda t: t.narrow(2, 3, 2).transpose(0, 2), Box((0, 0, 3), (6, 4, 2))),
        (lambda t: t[4], Box((4, 0, 0), (1, 4, 5))),
        (lambda t: t[1:3, 2:4, 1:2], Box((1, 2, 1), (2, 2, 1))),
        # Flattened rows: every element between the first and the last.
        (lambda t: t.narrow(0, 1, 2).reshape(-1), Box((1, 0, 0), (2, 4, 5))),
        (lambda t: t[2, 1:3].reshape(-1), Box((2, 1, 0), (1, 2, 5))),
        (lambda t: t[3, 2, 4], Box((3, 2, 4), (1, 1, 1))),
        (lambda t: t[0:1, 0:1, 0:1].expand(3, 4, 1), Box((0, 0, 0), (1, 1, 1))),
    ],
)
def test_the_box_of_a_view_holds_exactly_its_elements(make, box):
    base = torch.arange(6 * 4 * 5).view(6, 4, 5)
    view = make(base)
    assert view_box(make(torch.empty(6, 4, 5, device="meta")), (6, 4, 5)) == box
    covered = set(view.flatten().tolist())
    inside = base[tuple(slice(a, b) for a, b in zip(box.start, box.stop, strict=True))]
    assert covered <= set(inside.flatten().tolist())
    if view.dim() == base.dim() and view.stride() == base.stride():
        assert covered == set(inside.flatten().tolist())


def test_an_empty_view_reads_nothing_and_boxes_join():
    assert view_box(torch.empty(4, 4, device="meta")[2:2], (4, 4)) is None
    assert bounding([Box((0, 2), (1, 1)), Box((3, 0), (1, 1))]) == Box((0, 0), (4, 3))
    assert bounding([]) is None


class _Shards(torch.nn.Module):
    """TP rank 1 of 2, loaders written the engines' way."""

    def __init__(self) -> None:
        super().__init__()
        self.col = torch.nn.Parameter(torch.zeros(4, 6))
        self.row = torch.nn.Parameter(torch.zeros(8, 3))
        self.qkv = torch.nn.Parameter(torch.zeros(6, 6))
        self.fused = torch.nn.Parameter(torch.zeros(3, 6))
        self.norm = torch.nn.Parameter(torch.zeros(6))
        self.col.weight_loader = lambda p, w: p.data.copy_(w.narrow(0, 4, 4))
        self.row.weight_loader = lambda p, w: p.data.copy_(w.narrow(1, 3, 3))
        self.qkv.weight_loader = self._qkv
        self.fused.weight_loader = lambda p, w: p.data.copy_(w)

    @staticmethod
    def _qkv(param: torch.Tensor, loaded: torch.Tensor, shard_id: str) -> None:
        offset, rows = {"q": (0, 2), "k": (2, 2), "v": (4, 2)}[shard_id]
        start = loaded.shape[0] // 2  # rank 1 of 2
        param.data[offset : offset + rows] = loaded.narrow(0, start, rows)

    def load_weights(self, weights) -> None:
        pending = {}
        for name, w in weights:
            if name in ("q", "k", "v"):
                self.qkv.weight_loader(self.qkv, w, name)
            elif name in ("a", "b"):
                # Two checkpoint tensors concatenated, then the rank's rows taken.
                pending[name] = w
                if len(pending) == 2:
                    both = torch.cat([pending["a"], pending["b"]])
                    self.fused.weight_loader(self.fused, both.narrow(0, 1, 3))
            else:
                param = getattr(self, name)
                getattr(param, "weight_loader", lambda p, t: p.data.copy_(t))(param, w)


def test_each_name_keeps_the_box_its_loader_reads():
    specs = [
        TensorSpec("col", "float32", (8, 6)),
        TensorSpec("row", "float32", (8, 6)),
        TensorSpec("q", "float32", (4, 6)),
        TensorSpec("k", "float32", (4, 6)),
        TensorSpec("v", "float32", (4, 6)),
        TensorSpec("a", "float32", (2, 6)),
        TensorSpec("b", "float32", (2, 6)),
        TensorSpec("norm", "float32", (6,)),
    ]
    resolved = resolve_by_loading(_Shards(), specs)
    boxes = {name: hit.box for name, hit in resolved.items()}
    assert boxes == {
        "col": Box((4, 0), (4, 6)),
        "row": Box((0, 3), (8, 3)),
        "q": Box((2, 0), (2, 6)),
        "k": Box((2, 0), (2, 6)),
        "v": Box((2, 0), (2, 6)),
        "a": None,  # read whole by the concatenation
        "b": None,
        "norm": None,
    }
    # What a rank declares: the partial ones; a name some model takes whole is whole.
    assert kept_boxes(resolved) == {n: b for n, b in boxes.items() if b is not None}
    whole_col = replace(resolved["col"], box=None)  # a draft model loading ``col`` whole
    assert "col" not in kept_boxes(resolved, {"col": whole_col})
