"""Test helpers: a small mixed-dtype module and receivers running in their own processes."""

from __future__ import annotations

import multiprocessing as mp

import torch


class TinyNet(torch.nn.Module):
    """Mixed dtypes on purpose: fp32 and bf16 parameters, an int64 buffer, a scalar."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(300, 16, generator=g))  # > 4 KiB: chunked
        self.proj = torch.nn.Parameter(torch.randn(16, 16, generator=g).to(torch.bfloat16))
        self.norm = torch.nn.Parameter(torch.randn(16, generator=g))
        self.register_buffer("counts", torch.randint(0, 1000, (8,), generator=g))
        self.register_buffer("scale", torch.randn((), generator=g))


def step(model: torch.nn.Module, seed: int) -> None:
    """A stand-in optimizer step: change every tensor deterministically."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=g).to(t.dtype))
            else:
                t.add_(torch.randint(1, 5, t.shape, generator=g))


from weightsync.demo import state_digests as digests  # noqa: E402


def _receiver_main(address, rid, seed, syncs, die_on_version, ready, out, env):
    import os

    os.environ.update(env)
    from weightsync.receiver import TorchReceiver

    from weightsync.errors import WeightSyncError

    model = TinyNet(seed)
    receiver = TorchReceiver(model, address, receiver_id=rid)
    if die_on_version:
        load = receiver.target.load

        def load_then_die(tensors):
            if receiver_version[0] == die_on_version:
                import os

                os._exit(3)  # a crash mid-version, after the first bucket arrived
            load(tensors)

        receiver_version = [0]
        begin = receiver.target.begin
        receiver.target.begin = lambda m: (receiver_version.__setitem__(0, m.version), begin(m))
        receiver.target.load = load_then_die
    ready.put(rid)
    for _ in range(syncs):
        try:
            v = receiver.sync(timeout=60)
            out.put((rid, "applied", v, digests(model), ""))
        except WeightSyncError as e:
            out.put((rid, type(e).__name__, receiver.applied_version, digests(model), str(e)))


def start_receivers(
    address: str,
    ids: list[str],
    syncs: int,
    die_on_version: dict | None = None,
    env: dict | None = None,
):
    """Start one process per id; returns (processes, out queue) once all registered.

    ``env`` maps a receiver id to environment variables set in its process.
    """
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    procs = []
    for i, rid in enumerate(ids):
        p = ctx.Process(
            target=_receiver_main,
            daemon=True,
            args=(
                address,
                rid,
                100 + i,
                syncs,
                (die_on_version or {}).get(rid, 0),
                ready,
                out,
                (env or {}).get(rid, {}),
            ),
        )
        p.start()
        procs.append(p)
    for _ in ids:
        ready.get(timeout=60)
    return procs, out


def holder_module(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose state_dict has exactly these dotted names (a checkpoint-shaped holder)."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.register_buffer(leaf, tensor)
    return root
