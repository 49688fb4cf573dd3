"""The states of a version, of one receiver in one version, and of a receiver's weights.

String enums: their values are what ``Status`` and ``WaitApplied`` replies carry.
"""

from __future__ import annotations

from enum import StrEnum


class VersionState(StrEnum):
    """A version from its start to its end (``VersionStatus.state``)."""

    PACKING = "packing"
    """Planned and started: buckets are being packed and announced."""
    READING = "reading"
    """Every bucket and the end sent: only direct reads are owed before it is staged."""
    STAGED = "staged"
    """Nothing reads the publishers' memory any more: they may change it."""
    COMPLETE = "complete"
    """Every receiver applied it."""
    FAILED = "failed"
    """Abandoned, or some receiver failed it."""


class OutcomeState(StrEnum):
    """One receiver in one version (``ReceiverOutcome.state``)."""

    PENDING = "pending"
    APPLIED = "applied"
    FAILED = "failed"


class ReceiverState(StrEnum):
    """What a receiver's weights are now (``ReceiverStatus.state``)."""

    IDLE = "idle"
    """It holds the version it applied last."""
    APPLYING = "applying"
    """A version was addressed to it and it has not finished it."""
    DIRTY = "dirty"
    """Some bucket of a version it failed was written: its weights match no version."""
    FAILED = "failed"
    """It failed a version before writing: it still holds its last applied one."""
    DISCONNECTED = "disconnected"
