"""Joining the parts of a version that several senders (one per trainer host) send together.

Pure checks, no I/O: :class:`~.core.ReceiverCore` collects each sender's ``VersionStart`` and
asks :func:`join_parts` for the version they make together (validated against the live model
before any write), or for the error that names the part that does not fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from weightsync.errors import PlanError
from weightsync.manifest import VersionManifest


@dataclass(frozen=True)
class ArrivedPart:
    """A part's manifest and the address of the sender it came from."""

    address: str
    manifest: VersionManifest

    def __str__(self) -> str:
        part = self.manifest.part
        if part is None:
            return f"the whole version from the sender at {self.address}"
        return f"part {part.index} of {part.count} from sender {part.sender_id} at {self.address}"


def refuse_split(manifest: VersionManifest, address: str) -> None:
    """A receiver registered with one sender cannot apply one part of a split version.

    Raises:
        PlanError: ``manifest`` is one part of several.
    """
    part = manifest.part
    if part is not None:
        raise PlanError(
            f"version {manifest.version} is split over {part.count} senders (this one: "
            f"{part.sender_id} at {address}); register the receiver with every sender's address"
        )


def check_part(arrived: ArrivedPart, addresses: Sequence[str]) -> None:
    """``arrived`` fits a receiver registered with the senders at ``addresses`` (2 or more).

    Raises:
        PlanError: the version came whole, or is split over another number of senders.
    """
    version, part = arrived.manifest.version, arrived.manifest.part
    if part is None:
        raise PlanError(
            f"version {version} came whole from the sender at {arrived.address}, but this "
            f"receiver is registered with {len(addresses)} senders ({', '.join(addresses)}): "
            "publish every version split over all of them (Publisher.publish(part=...))"
        )
    if part.count != len(addresses):
        raise PlanError(
            f"version {version} is split over {part.count} senders (this one: "
            f"{part.sender_id} at {arrived.address}) but this receiver is registered with "
            f"{len(addresses)} ({', '.join(addresses)}); register the receiver with every "
            "sender's address"
        )


def join_parts(parts: Sequence[ArrivedPart]) -> VersionManifest:
    """The version ``parts`` make together: every tensor of every part, in part order.

    Raises:
        PlanError: the parts disagree on the plan (digest, part count, tensor count, LoRA
            adapter), a part index is missing or sent twice, a tensor is in two parts, or
            the union is not the announced number of tensors; the message names the parts.
    """
    first = parts[0]
    version, want = first.manifest.version, first.manifest.part
    if want is None:
        raise PlanError(f"version {version}: {first} is not one part of several")
    by_index: dict[int, ArrivedPart] = {}
    for arrived in parts:
        part = arrived.manifest.part
        if part is None:
            raise PlanError(
                f"version {version}: {arrived} came beside {first}; a version is either whole "
                "or split over every sender"
            )
        if part.plan_digest != want.plan_digest:
            raise PlanError(
                f"version {version}: {arrived} has plan_digest {part.plan_digest}, but {first} "
                f"has {want.plan_digest}: the senders published different plans (a stale or "
                "foreign part); publish the version again from every sender"
            )
        if (part.count, part.num_tensors) != (want.count, want.num_tensors):
            raise PlanError(
                f"version {version}: {arrived} announces {part.count} parts and "
                f"{part.num_tensors} tensors, but {first} announces {want.count} and "
                f"{want.num_tensors}"
            )
        if arrived.manifest.lora != first.manifest.lora:
            raise PlanError(
                f"version {version}: {arrived} and {first} announce different LoRA adapters"
            )
        if part.index in by_index:
            raise PlanError(
                f"version {version}: {by_index[part.index]} and {arrived} are the same part; "
                "give each sender its own part index"
            )
        by_index[part.index] = arrived
    missing = [i for i in range(want.count) if i not in by_index]
    if missing:
        got = "; ".join(str(by_index[i]) for i in sorted(by_index))
        raise PlanError(
            f"version {version}: part {missing[0]} of {want.count} is missing (got {got})"
        )
    owner: dict[str, ArrivedPart] = {}
    tensors = []
    for index in range(want.count):
        arrived = by_index[index]
        for spec in arrived.manifest.tensors:
            if spec.name in owner:
                raise PlanError(
                    f"version {version}: tensor {spec.name!r} is in {owner[spec.name]} and in "
                    f"{arrived}; each tensor belongs to exactly one part"
                )
            owner[spec.name] = arrived
            tensors.append(spec)
    if len(tensors) != want.num_tensors:
        raise PlanError(
            f"version {version}: its {want.count} parts carry {len(tensors)} tensors together "
            f"but announce {want.num_tensors} (num_tensors)"
        )
    return VersionManifest(version, tuple(tensors), first.manifest.lora)
