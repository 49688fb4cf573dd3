"""The weightsync exception hierarchy and its mapping onto gRPC status codes.

Every message names the first offending tensor, field or peer, and says what to do.
"""

from __future__ import annotations

import grpc


class WeightSyncError(Exception):
    """Base of every error weightsync raises on purpose."""

    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class ConfigError(WeightSyncError):
    """A setting or argument is invalid (bad address, bucket size, transport name)."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class PlanError(WeightSyncError):
    """Tensors cannot be planned into buckets, or Megatron shards into HF tensors."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class TransportError(WeightSyncError):
    """A data-plane buffer could not be created, opened or read."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class NameResolutionError(WeightSyncError):
    """A tensor name cannot be resolved against the live model."""

    grpc_code = grpc.StatusCode.NOT_FOUND


class ManifestMismatchError(WeightSyncError):
    """A tensor exists but its shape or dtype differs from the live model's."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class ChecksumError(WeightSyncError):
    """A bucket's bytes do not match the checksum the sender announced."""

    grpc_code = grpc.StatusCode.DATA_LOSS


class VersionError(WeightSyncError):
    """A version is not greater than the last one, or is unknown."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class WrongBaseError(VersionError):
    """A delta was to be applied onto bytes other than the version it was made from (a
    receiver that missed a version, or joined late): it needs the full bytes instead."""


class ProtocolError(WeightSyncError):
    """A peer sent a message out of order or broke the stream."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class SyncTimeoutError(WeightSyncError):
    """Waiting for a peer (ack, version, free buffer) took longer than the deadline."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class ReceiverFailedError(WeightSyncError):
    """One or more receivers did not apply a version; the message lists each and why."""

    grpc_code = grpc.StatusCode.ABORTED


class ReplacedError(WeightSyncError):
    """Another connection registered this receiver's id (a restarted engine takes its id
    back): this one is closed and does not register again."""

    grpc_code = grpc.StatusCode.ALREADY_EXISTS


def grpc_code_for(error: BaseException) -> grpc.StatusCode:
    """The gRPC status code a server answers with for ``error``."""
    if isinstance(error, WeightSyncError):
        return error.grpc_code
    return grpc.StatusCode.INTERNAL


def rpc_details(error: WeightSyncError) -> str:
    """What a server sends as a status's details: our exception's name, then its message."""
    return f"{type(error).__name__}: {error}"


_CODE_TO_ERROR: dict[grpc.StatusCode, type[WeightSyncError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: ConfigError,
    grpc.StatusCode.NOT_FOUND: NameResolutionError,
    grpc.StatusCode.DATA_LOSS: ChecksumError,
    grpc.StatusCode.DEADLINE_EXCEEDED: SyncTimeoutError,
    grpc.StatusCode.ABORTED: ReceiverFailedError,
    grpc.StatusCode.UNAVAILABLE: TransportError,
    grpc.StatusCode.ALREADY_EXISTS: ReplacedError,
    # A token or certificate that does not match is a setting to fix, not a protocol bug.
    grpc.StatusCode.UNAUTHENTICATED: ConfigError,
}


def error_from_rpc(error: grpc.RpcError, what: str) -> WeightSyncError:
    """Turn a failed RPC into our exception type, keeping the server's message.

    The type comes from the name :func:`rpc_details` put in front of the message; statuses
    that carry none (grpc's own) map by code.

    Args:
        error: the exception grpc raised.
        what: what the caller was doing, e.g. ``"publish version 3 to unix:/tmp/ws.sock"``.
    """
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else str(error)) or ""
    name, sep, message = details.partition(": ")
    cls = globals().get(name) if sep else None
    if isinstance(cls, type) and issubclass(cls, WeightSyncError):
        return cls(f"{what}: {message}")
    if code == grpc.StatusCode.UNAVAILABLE:
        return TransportError(
            f"{what}: sender unreachable ({details}). Is `weightsync-sender` running and is the "
            "address right (unix:/path or host:port)?"
        )
    return _CODE_TO_ERROR.get(code, ProtocolError)(f"{what}: {details}")
