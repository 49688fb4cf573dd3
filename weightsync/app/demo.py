"""``weightsync demo``: a sender, a trainer process and receiver processes on one machine.

The trainer holds a tiny Qwen2-shaped model with random weights (transformers' Qwen2ForCausalLM
where transformers is installed, else a plain-torch module with the same tensor names and
shapes, so a core install runs the demo); each receiver holds its own copy with different random
weights. For every version the trainer changes its weights (a stand-in optimizer step) and
publishes; then every receiver's weights are compared with the trainer's by SHA-256 of each
tensor's bytes, which is a bit-for-bit comparison.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import tempfile
from dataclasses import dataclass

import torch

from weightsync.buckets import byte_view

_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class DemoConfig:
    versions: int = 3
    receivers: int = 2
    transport: str = "auto"
    bucket_size_bytes: int = 1 << 20
    """Small on purpose: the tiny model then spans several buckets and its embedding is chunked."""
    device: str = "auto"


TINY_QWEN2 = dict(
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
"""The demo model's ``Qwen2Config`` fields: small enough for a CPU, head_dim 32."""


def _tiny_qwen2(seed: int, device: str) -> torch.nn.Module:
    torch.manual_seed(seed)
    try:
        from transformers import Qwen2Config, Qwen2ForCausalLM
    except ImportError:
        return _torch_qwen2(TINY_QWEN2).to(device).eval()
    return Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2)).to(device).eval()


def _torch_qwen2(c: dict) -> torch.nn.Module:
    """Weights only (no forward): the state_dict names and shapes of transformers'
    ``Qwen2ForCausalLM(Qwen2Config(**c))``, built from plain torch modules."""
    nn = torch.nn
    h, inter = c["hidden_size"], c["intermediate_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]

    def layer() -> nn.Module:
        attn, mlp, block = nn.Module(), nn.Module(), nn.Module()
        attn.q_proj, attn.k_proj, attn.v_proj = nn.Linear(h, h), nn.Linear(h, kv), nn.Linear(h, kv)
        attn.o_proj = nn.Linear(h, h, bias=False)
        mlp.gate_proj = nn.Linear(h, inter, bias=False)
        mlp.up_proj = nn.Linear(h, inter, bias=False)
        mlp.down_proj = nn.Linear(inter, h, bias=False)
        block.self_attn, block.mlp = attn, mlp
        block.input_layernorm, block.post_attention_layernorm = nn.RMSNorm(h), nn.RMSNorm(h)
        return block

    model, top = nn.Module(), nn.Module()
    model.embed_tokens = nn.Embedding(c["vocab_size"], h)
    model.layers = nn.ModuleList(layer() for _ in range(c["num_hidden_layers"]))
    model.norm = nn.RMSNorm(h)
    top.model, top.lm_head = model, nn.Linear(h, c["vocab_size"], bias=False)
    return top


def state_digests(model: torch.nn.Module) -> dict[str, str]:
    """SHA-256 of every state_dict tensor's bytes: equal digests mean bit-identical weights."""
    return {
        name: hashlib.sha256(byte_view(t.detach().contiguous().cpu()).numpy()).hexdigest()
        for name, t in model.state_dict().items()
    }


def _trainer(address: str, cfg: DemoConfig, device: str, start: mp.Event, out: mp.Queue) -> None:
    from weightsync.sender import Publisher

    try:
        model = _tiny_qwen2(seed=0, device=device)
        publisher = Publisher(address, publisher_id="demo-trainer")
        start.wait(_TIMEOUT_S)
        for version in range(1, cfg.versions + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            result = publisher.publish(model.state_dict(), version, wait=True, timeout_s=_TIMEOUT_S)
            out.put(("trainer", version, state_digests(model), result.staged_s, None))
    except Exception as e:  # reported to the parent, which prints it and exits non-zero
        out.put(("trainer", 0, {}, 0.0, f"{type(e).__name__}: {e}"))


def _receiver(
    address: str, cfg: DemoConfig, device: str, index: int, ready: mp.Queue, out: mp.Queue
) -> None:
    from weightsync.receiver import TorchReceiver

    name = f"receiver-{index}"
    try:
        model = _tiny_qwen2(seed=100 + index, device=device)
        receiver = TorchReceiver(model, address, receiver_id=f"demo-{name}")
        ready.put(name)
        for _ in range(cfg.versions):
            version = receiver.sync(timeout=_TIMEOUT_S)
            out.put((name, version, state_digests(model), 0.0, None))
    except Exception as e:
        ready.put(name)
        out.put((name, 0, {}, 0.0, f"{type(e).__name__}: {e}"))


def run_demo(cfg: DemoConfig, console) -> bool:
    """Run the demo; returns whether every version reached every receiver bit-exactly."""
    from rich.progress import Progress

    from weightsync.sender import Sender

    device = cfg.device
    if device == "auto":
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    ctx = mp.get_context("spawn")
    sock = os.path.join(tempfile.mkdtemp(prefix="weightsync-demo-"), "sender.sock")
    with Sender(
        f"unix:{sock}", transport=cfg.transport, bucket_size_bytes=cfg.bucket_size_bytes
    ) as sender:
        console.print(f"sender on {sender.address}, transport {cfg.transport}, device {device}")
        out, ready, start = ctx.Queue(), ctx.Queue(), ctx.Event()
        procs = [
            ctx.Process(
                target=_receiver, args=(sender.address, cfg, device, i, ready, out), daemon=True
            )
            for i in range(cfg.receivers)
        ]
        procs.append(
            ctx.Process(
                target=_trainer, args=(sender.address, cfg, device, start, out), daemon=True
            )
        )
        for p in procs:
            p.start()
        for _ in range(cfg.receivers):
            ready.get(timeout=_TIMEOUT_S)
        start.set()
        results: dict[tuple[str, int], dict[str, str]] = {}
        ok = True
        expected = cfg.versions * (cfg.receivers + 1)
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("syncing", total=expected)
            for _ in range(expected):
                try:
                    who, version, digests, staged_s, error = out.get(timeout=_TIMEOUT_S)
                except queue.Empty:
                    console.print("[red]timed out waiting for the trainer or a receiver[/red]")
                    ok = False
                    break
                progress.advance(task)
                if error:
                    console.print(f"[red]{who} failed: {error}[/red]")
                    ok = False
                    break
                results[(who, version)] = digests
                if who == "trainer":
                    console.print(f"version {version}: staged in {staged_s * 1000:.1f} ms")
        for version in range(1, cfg.versions + 1):
            trainer = results.get(("trainer", version))
            for i in range(cfg.receivers):
                got = results.get((f"receiver-{i}", version))
                same = trainer is not None and got == trainer
                ok = ok and same
                console.print(
                    f"version {version} receiver-{i}: "
                    f"{'bit-exact' if same else 'MISMATCH or missing'}"
                )
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return ok
