"""Configuration models. Every field can be set by an env var with the ``WEIGHTSYNC_`` prefix.

An invalid value raises :class:`~weightsync.errors.ConfigError` with one line naming the setting
as it was given (``WEIGHTSYNC_NUM_BUFFERS`` for an env var, ``num_buffers`` for a keyword) and
the values it accepts; never pydantic's multi-line ``ValidationError``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from weightsync.errors import ConfigError

# The bucket format's sizes live here, not in weightsync.buckets (which imports torch), so that
# settings and the CLI stay light: `weightsync --version` or `status` start fast.
ALIGNMENT_BYTES = 256
DEFAULT_BUCKET_SIZE_BYTES = 512 * 1024 * 1024


def check_bucket_size(bucket_size_bytes: int) -> int:
    """Validate a bucket cap; it must be a positive multiple of the alignment."""
    if bucket_size_bytes < ALIGNMENT_BYTES or bucket_size_bytes % ALIGNMENT_BYTES:
        raise ConfigError(
            f"bucket_size_bytes={bucket_size_bytes} must be a positive multiple of "
            f"{ALIGNMENT_BYTES} (e.g. {DEFAULT_BUCKET_SIZE_BYTES} for 512 MiB)"
        )
    return bucket_size_bytes


DEFAULT_ADDRESS = "unix:/tmp/weightsync.sock"
ENV_PREFIX = "WEIGHTSYNC_"
ADDRESS_ENV = "WEIGHTSYNC_ADDRESS"
"""Where clients (``weightsync status``, engine hooks) find the sender; falls back to
``WEIGHTSYNC_LISTEN``, the address the sender listens on, then :data:`DEFAULT_ADDRESS`."""

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")


def client_address(environ: Mapping[str, str] | None = None) -> str:
    """The sender address a client on this host uses when none is given: ``$WEIGHTSYNC_ADDRESS``,
    else ``$WEIGHTSYNC_LISTEN`` (what ``weightsync-sender`` reads), else the default."""
    env = os.environ if environ is None else environ
    return env.get(ADDRESS_ENV) or env.get(f"{ENV_PREFIX}LISTEN") or DEFAULT_ADDRESS


class _Settings(BaseSettings):
    """Settings whose validation errors are one-line :class:`ConfigError` s."""

    ACCEPTED: ClassVar[dict[str, str]] = {}
    """Per field: the values it accepts, in words (said in every error about it)."""

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise ConfigError(describe_validation_error(e, type(self), values)) from None


def setting_name(cls: type[BaseSettings], field: str, given: Mapping[str, Any]) -> str:
    """How the user spelt ``field``: the keyword when given as one, else its env var."""
    if field in given:
        return field
    prefix = cls.model_config.get("env_prefix", "")
    return f"{prefix}{field}".upper()


def describe_validation_error(
    error: ValidationError, cls: type[_Settings], given: Mapping[str, Any]
) -> str:
    """One line for every invalid setting in ``error``: its name, value and what it accepts."""
    parts = []
    for item in error.errors():
        field = str(item["loc"][0]) if item["loc"] else "?"
        if item["type"] == "extra_forbidden":
            known = ", ".join(cls.model_fields)
            parts.append(f"unknown setting {field!r}; known: {known}")
            continue
        name = setting_name(cls, field, given)
        accepted = cls.ACCEPTED.get(field)
        if accepted is None:
            msg = item["msg"].removeprefix("Value error, ")
            accepted = msg[:1].lower() + msg[1:]
        parts.append(f"{name}={item.get('input')!r} is invalid; expected {accepted}")
    return "; ".join(parts)


_SECURITY_ACCEPTED = {
    "token": "a shared secret of printable ASCII without spaces (e.g. `openssl rand -hex 32`)",
    "token_file": "a readable file holding the token (one line)",
    "tls_cert": "a readable PEM certificate chain file, with tls_key",
    "tls_key": "a readable PEM private key file, with tls_cert",
}


class ClientSettings(_Settings):
    """How every client (publishers, receivers, ``weightsync status`` / ``wait``) proves itself
    to the sender: ``WEIGHTSYNC_TOKEN`` or ``WEIGHTSYNC_TOKEN_FILE``, and for TLS
    ``WEIGHTSYNC_TLS_CA`` (the CA that signed the sender's certificate) with
    ``WEIGHTSYNC_TLS_CERT`` / ``WEIGHTSYNC_TLS_KEY`` (this client's, when the sender asks)."""

    # Other WEIGHTSYNC_* variables (the sender's) share the environment: ignored here.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")
    ACCEPTED: ClassVar[dict[str, str]] = {
        **_SECURITY_ACCEPTED,
        "tls_ca": "a readable PEM file of the CA that signed the sender's certificate",
        "lanes": "true or false (default true)",
        "receiver_delta_bytes": "a number of bytes >= 0 (default 0: no deltas)",
        "receiver_sender_writes": "true or false (default true)",
    }

    token: SecretStr | None = None
    token_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    lanes: bool = True
    """Take a same-host lane the sender offers (``weightsync/control/lanes.py``)."""
    receiver_delta_bytes: int = Field(0, ge=0)
    """A receiver keeps the last bytes of each broadcast bucket, up to this many in all, so
    the sender may send the next version's as deltas (``ReceiverHello.deltas``; 0: off)."""
    receiver_sender_writes: bool = True
    """A receiver on the GPU where its sender stages lets the sender write its weights
    (``WriteOffer``, protocol §4.3): one process's kernels on that GPU, not two taking turns."""


class SenderSettings(_Settings):
    """Settings of the sender daemon (``weightsync-sender``)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")
    ACCEPTED: ClassVar[dict[str, str]] = {
        "listen": "unix:/abs/path or host:port (e.g. 127.0.0.1:50551; port 0: any free port)",
        "bucket_size_bytes": f"a positive multiple of {ALIGNMENT_BYTES} bytes "
        f"(default {DEFAULT_BUCKET_SIZE_BYTES}, 512 MiB)",
        "num_buffers": "an integer >= 2 (default 2)",
        "transport": "one of auto, shm, cuda_ipc, nccl",
        "broadcast_host": "a host name or IP address of this machine (default 127.0.0.1)",
        "ack_timeout_s": "a number of seconds > 0 (default 120)",
        "pack_timeout_s": "a number of seconds > 0 (default 600)",
        "stall_timeout_s": "a number of seconds > 0 (default 60)",
        "metrics_port": "a TCP port 0-65535 (0, the default: no metrics endpoint)",
        "metrics_host": "an address to bind the metrics endpoint to (default 127.0.0.1; "
        "0.0.0.0 for every interface)",
        "history": "an integer >= 1 (default 64)",
        "receiver_ttl_s": "a number of seconds >= 0 (default 300)",
        "max_disconnected_receivers": "an integer >= 0 (default 256)",
        "max_streams": "an integer >= 1 (default 1024)",
        "hello_timeout_s": "a number of seconds > 0 (default 10)",
        "retain_bytes": "a number of bytes >= 0 (default 0: retain nothing)",
        "delta_bytes": "a number of bytes >= 0 (default 0: no deltas)",
        **_SECURITY_ACCEPTED,
        "tls_ca": "a readable PEM file of the CA that signs client certificates (then every "
        "client must present one)",
        "insecure": "true or false (default false)",
        "socket_group": "a group name or id of this machine (default: none, the socket is 0600)",
        "lanes": "true or false (default true)",
        "armed_starts": "true or false (default true)",
    }

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
        600.0, gt=0, description="a version's publishers packing longer than this abandon it"
    )
    stall_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a version's publishers packing nothing this long abandon it (versions "
        "queued behind a stalled one wait no longer)",
    )
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus metrics port; 0 = off")
    metrics_host: str = Field(
        "127.0.0.1", min_length=1, description="address the metrics endpoint binds to"
    )
    history: int = Field(64, ge=1, description="how many versions Status keeps")
    receiver_ttl_s: float = Field(
        300.0,
        ge=0,
        description="a disconnected receiver is dropped from Status after this long (one "
        "that registers again reports its own applied version)",
    )
    max_disconnected_receivers: int = Field(
        256, ge=0, description="Status keeps at most this many disconnected receivers (oldest go)"
    )
    max_streams: int = Field(
        1024,
        ge=1,
        description="open Publish/Receive streams (publisher ranks plus receivers) one sender "
        "serves; each holds a thread; past it a new stream is refused, saying so",
    )
    hello_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a Publish/Receive stream whose hello has not arrived this long after it "
        "opened is closed (DEADLINE_EXCEEDED): a mute stream holds a thread and a stream slot",
    )
    retain_bytes: int = Field(
        0,
        ge=0,
        description="keep the last version applied in host memory, when its staged bytes fit, "
        "so a receiver that registers behind it catches up even when no engine holds it "
        "(0: retain nothing; engines that hold it are the sources first)",
    )
    delta_bytes: int = Field(
        0,
        ge=0,
        description="keep each broadcast bucket's last bytes, up to this many in all (on the "
        "staging device), to send the next version's bucket as an exact delta to a group whose "
        "receivers all hold them (0: every byte, every version)",
    )
    token: SecretStr | None = Field(
        None, description="shared secret every client must send (authorization: Bearer)"
    )
    token_file: str | None = Field(None, description="a file holding the token")
    tls_cert: str | None = Field(None, description="PEM certificate chain of the sender")
    tls_key: str | None = Field(None, description="PEM private key of the sender")
    tls_ca: str | None = Field(
        None, description="PEM CA bundle; given, every client must present a certificate it signs"
    )
    insecure: bool = Field(
        False, description="allow TCP with neither token nor TLS (a trusted network only)"
    )
    socket_group: str | None = Field(
        None, description="a unix socket's group: the socket is then 0660 instead of 0600"
    )
    lanes: bool = Field(
        True,
        description="offer clients on this machine a Unix-socket lane for their streams' "
        "messages (same messages, without gRPC's per-message thread handoffs)",
    )
    armed_starts: bool = Field(
        True,
        description="send a direct version whose plan repeats the last one's to its receivers "
        "before planning it, so their copies start while it is planned (false: plan first)",
    )

    @field_validator("bucket_size_bytes")
    @classmethod
    def _aligned(cls, v: int) -> int:
        try:
            return check_bucket_size(v)
        except ConfigError as e:  # pydantic reports only ValueErrors as validation errors
            raise ValueError(str(e)) from None


class LogSettings(_Settings):
    """How a weightsync process logs: ``WEIGHTSYNC_LOG_LEVEL``, ``WEIGHTSYNC_LOG_FORMAT``."""

    model_config = SettingsConfigDict(env_prefix=f"{ENV_PREFIX}LOG_", extra="forbid")
    ACCEPTED: ClassVar[dict[str, str]] = {
        "level": f"one of {', '.join(LOG_LEVELS)} (default info)",
        "format": "text (one line per record; rich on a terminal) or json (one object per line)",
    }

    level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    format: Literal["text", "json"] = "text"

    @field_validator("level", "format", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v
