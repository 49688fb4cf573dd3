"""What the sender accepts of a client's first messages: the publisher's and receiver's hellos
(beyond the bounds :mod:`weightsync.limits` puts on every field) and a version's manifest."""

from __future__ import annotations

import torch

from weightsync import limits
from weightsync.errors import ConfigError
from weightsync.v1 import weightsync_pb2 as pb

RECEIVER_TRANSPORTS = ("shm", "cuda_ipc")
"""The staging transports a receiver may name in ``ReceiverHello.transports``."""
_PUBLISHER_DEVICES = "'cpu' or 'cuda:N' (where this rank's tensors live)"


def check_publisher_hello(hello: pb.PublisherHello) -> None:
    """ConfigError naming the field of a hello this sender cannot serve."""
    limits.check_publisher_hello(hello)
    world = max(hello.world_size, 1)
    if hello.rank >= world:
        raise ConfigError(
            f"publisher rank {hello.rank} is not below world_size {world} "
            "(PublisherHello.rank, PublisherHello.world_size)"
        )
    if not hello.device:
        raise ConfigError(f"PublisherHello.device is empty; send {_PUBLISHER_DEVICES}")
    device = _parse_device(hello.device, "PublisherHello.device", _PUBLISHER_DEVICES)
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"PublisherHello.device {hello.device!r} is not supported; send {_PUBLISHER_DEVICES}"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"PublisherHello.device {hello.device!r}: this sender sees no CUDA device; run "
                "it where the trainer's GPUs are visible, or publish CPU tensors"
            )
        count = torch.cuda.device_count()
        if not hello.device_uuid and (device.index or 0) >= count:
            raise ConfigError(
                f"PublisherHello.device {hello.device!r}: this sender sees {count} GPU(s); "
                "send PublisherHello.device_uuid so it finds the GPU by UUID"
            )


def check_manifest_not_empty(manifest: pb.Manifest) -> None:
    """A version with no tensors would be started and reported applied while changing
    nothing: refused (ConfigError naming the field) before it takes the version number."""
    if not manifest.tensors:
        raise ConfigError(
            f"BeginVersion.manifest of version {manifest.version} has no tensors; "
            "publish at least one"
        )


def check_receiver_hello(hello: pb.ReceiverHello) -> None:
    """ConfigError naming the field of a receiver hello that cannot be right. The device is
    the receiver's own (its numbering, maybe another host): only its form is checked."""
    limits.check_receiver_hello(hello)
    for i, name in enumerate(hello.transports):
        if name not in RECEIVER_TRANSPORTS:
            raise ConfigError(
                f"ReceiverHello.transports[{i}] {name!r} is not a transport; known: "
                f"{', '.join(RECEIVER_TRANSPORTS)} (or send none: any)"
            )
    if hello.device:
        _parse_device(hello.device, "ReceiverHello.device", "'cpu', 'cuda:N', or empty")


def _parse_device(text: str, field: str, accepted: str) -> torch.device:
    try:
        return torch.device(text)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ConfigError(f"{field} {text!r} is not a device; send {accepted}") from e
