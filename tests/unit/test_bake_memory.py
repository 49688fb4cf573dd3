"""The bake reads its stand-ins in chunks of rows (issue 31: memory for a chunk, not a multiple
of the module): the placements equal those of a reading in one piece, a replay of them equals
the model's own loaders bit for bit, and loaders that compute or write constants are still
refused, on a toy model shaped like an engine's (packed qkv, fused experts, a padded vocab)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.replay_proof import replay_differs
from weightsync.buckets import TensorSpec
from weightsync.receiver import landings
from weightsync.receiver.bake import bake
from weightsync.receiver.loader_dry_run import live_tensors
from weightsync.receiver.name_resolver import resolve_by_loading

E, FF, H, V, PAD = 3, 4, 6, 10, 2


class Toy(torch.nn.Module):
    def __init__(self, expert_loader=None) -> None:
        super().__init__()
        self.embed = torch.nn.Module()
        self.embed.weight = _param((V + PAD, H), _vocab_loader)
        self.attn = torch.nn.Module()
        self.attn.qkv = _param((3 * H, H), _qkv_loader)
        self.experts = torch.nn.Module()
        self.experts.w13 = _param((E, 2 * FF, H), expert_loader or _w13_loader)
        self.experts.w2 = _param((E, H, FF), _w2_loader)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.zeros(H), requires_grad=False)

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        for name, t in weights:
            parts = name.split(".")
            if parts[0] == "experts":
                e, kind = int(parts[1]), parts[2]
                if kind == "down":
                    p = params["experts.w2"]
                    p.weight_loader(p, t, expert_id=e)
                else:
                    p = params["experts.w13"]
                    p.weight_loader(p, t, shard_id=kind, expert_id=e)
            elif parts[0] in "qkv":
                p = params["attn.qkv"]
                p.weight_loader(p, t, parts[0])
            else:
                p = params[name]
                getattr(p, "weight_loader", _copy)(p, t)
        return set(params)


def _param(shape, loader) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
    p.weight_loader = loader
    return p


def _copy(param, loaded_weight):
    param.data.copy_(loaded_weight)


def _vocab_loader(param, loaded_weight):
    param.data[:V].copy_(loaded_weight)
    param.data[V:].zero_()


def _qkv_loader(param, loaded_weight, shard_id):
    at = "qkv".index(shard_id) * H
    param.data[at : at + H].copy_(loaded_weight)


def _w13_loader(param, loaded_weight, shard_id, expert_id):
    at = 0 if shard_id == "gate" else FF
    param.data[expert_id, at : at + FF].copy_(loaded_weight)


def _w2_loader(param, loaded_weight, expert_id):
    param.data[expert_id].copy_(loaded_weight)


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    shapes = {"embed.weight": (V, H), "norm.weight": (H,), **{n: (H, H) for n in "qkv"}}
    for e in range(E):
        shapes |= {f"experts.{e}.gate": (FF, H), f"experts.{e}.up": (FF, H)}
        shapes[f"experts.{e}.down"] = (H, FF)
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def _baked(model: Toy):
    tensors = _tensors()
    specs = [TensorSpec.of(n, t) for n, t in tensors.items()]
    loading = live_tensors(model)
    resolved = resolve_by_loading(model, specs, loading)
    return bake(model, specs, resolved, loading, {n for n, _ in model.named_modules()})


@pytest.mark.parametrize("chunk", [1, 5, 13, 1 << 23])
def test_a_reading_in_chunks_places_as_one_in_one_piece_and_replays_exactly(chunk, monkeypatch):
    whole = _baked(Toy())
    assert not whole.refused
    monkeypatch.setattr(landings, "READ_CHUNK", chunk)
    chunked = _baked(Toy())
    assert chunked.placements == whole.placements
    # gate and up of each expert: one box each; qkv: three; the vocab's padding: one zero box
    w13 = [p for ps in chunked.placements.values() for p in ps if p.live_name == "experts.w13"]
    assert len(w13) == 2 * E
    pad = [p for p in chunked.placements["embed.weight"] if p.zero]
    assert [(p.start, p.size) for p in pad] == [((V, 0), (PAD, H))]
    model = Toy()
    differing, refused = replay_differs(model, _tensors(), live_tensors(model))
    assert (differing, refused) == ([], {})


def test_a_planted_fault_is_caught_after_a_chunked_reading(monkeypatch):
    monkeypatch.setattr(landings, "READ_CHUNK", 5)
    model = Toy()

    def plant(baked):  # expert 1's up lands in expert 2's slot
        ps = baked.placements["experts.1.up"]
        ps[0] = dataclasses.replace(ps[0], start=(2, *ps[0].start[1:]))

    differing, _ = replay_differs(model, _tensors(), live_tensors(model), corrupt=plant)
    assert differing


def _plus_one(param, loaded_weight, shard_id, expert_id):
    _w13_loader(param, loaded_weight + 1, shard_id, expert_id)


def _constant(param, loaded_weight, shard_id, expert_id):
    _w13_loader(param, torch.full_like(loaded_weight, 5), shard_id, expert_id)


def _small(param, loaded_weight, shard_id, expert_id):
    _w13_loader(param, loaded_weight % 7 + 1, shard_id, expert_id)


@pytest.mark.parametrize(
    ("loader", "why"),
    [
        (_plus_one, "compute values, not only move them"),
        (_constant, "write constants other than 0"),
        (_small, "compute values, not only move them"),  # constants that move in the second
    ],
)
@pytest.mark.parametrize("chunk", [5, 1 << 23])
def test_loaders_that_compute_or_write_constants_are_refused(loader, why, chunk, monkeypatch):
    monkeypatch.setattr(landings, "READ_CHUNK", chunk)
    baked = _baked(Toy(loader))
    assert why in baked.refused["experts"]
    assert not any(n.startswith("experts.") for n in baked.placements)
    assert "embed.weight" in baked.placements
