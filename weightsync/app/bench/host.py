"""What the bench runs on: a one-line description for the report, and whether it fits."""

from __future__ import annotations

import platform

import torch

from weightsync.errors import ConfigError


def machine(device: torch.device) -> str:
    if device.type != "cuda":
        return f"CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}"
    n = torch.cuda.device_count()
    return f"{n} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"


def check_memory(nbytes: int, bucket: int) -> None:
    # cuda:0 holds the trainer shards, the HF-tensor copies (floor twin and baseline source),
    # the colocated receiver's model and the staging buffers at once; for a moment also the
    # flat-copy floor's twin of the shards.
    need = 4 * nbytes + 2 * bucket
    free, _ = torch.cuda.mem_get_info(0)
    if need > free:
        raise ConfigError(
            f"the bench needs about {need / 1e9:.1f} GB on cuda:0 for this model, "
            f"{free / 1e9:.1f} GB are free: cut the model with --layers N"
        )
