"""Configuration models. Every field can be set by an env var with the ``WEIGHTSYNC_`` prefix."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from weightsync.buckets import DEFAULT_BUCKET_SIZE_BYTES, check_bucket_size
from weightsync.errors import ConfigError

DEFAULT_ADDRESS = "unix:/tmp/weightsync.sock"


class SenderSettings(BaseSettings):
    """Settings of the sender daemon (``weightsync-sender``)."""

    model_config = SettingsConfigDict(env_prefix="WEIGHTSYNC_", extra="forbid")

    listen: str = Field(DEFAULT_ADDRESS, description="unix:/path or host:port (port 0: any)")
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    num_buffers: int = Field(2, ge=2, description="staging buffers; >= 2 so packing overlaps")
    transport: Literal["auto", "shm", "cuda_ipc", "nccl"] = Field(
        "auto",
        description="auto: receivers on this host map the staging buffers (cuda_ipc for CUDA "
        "tensors, shm for CPU ones), receivers on other hosts get broadcasts; nccl: broadcast "
        "to every receiver (gloo for CPU staging)",
    )
    broadcast_host: str = Field(
        "127.0.0.1", description="address remote receivers reach the broadcast rendezvous at"
    )
    ack_timeout_s: float = Field(
        120.0, gt=0, description="a receiver silent this long during a version is failed for it"
    )
    pack_timeout_s: float = Field(
        600.0, gt=0, description="a publisher silent this long while packing abandons the version"
    )
    metrics_port: int = Field(0, ge=0, description="Prometheus metrics port; 0 = off")
    history: int = Field(64, ge=1, description="how many versions Status keeps")

    @field_validator("bucket_size_bytes")
    @classmethod
    def _aligned(cls, v: int) -> int:
        try:
            return check_bucket_size(v)
        except ConfigError as e:  # pydantic reports only ValueErrors as validation errors
            raise ValueError(str(e)) from None
