"""Stable names for torch dtypes on the wire (never ``str(dtype)``, which varies)."""

from __future__ import annotations

import torch

from weightsync.errors import ConfigError

_BY_NAME: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_BY_DTYPE = {v: k for k, v in _BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise ConfigError(
            f"dtype {dtype} is not supported on the wire; supported: {sorted(_BY_NAME)}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a wire name; raises ConfigError listing the known names."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {name!r} on the wire; known: {sorted(_BY_NAME)}"
        ) from None


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize
