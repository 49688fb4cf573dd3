"""``WeightTarget``: what an engine adapter implements; the receiver core drives it per version.

Each bucket reaches the target as one :class:`Arrival` (``WeightTarget.load``); a target that
works out its copies once per mapped buffer keeps them in :class:`Batches`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from weightsync import summed_copies
from weightsync.buckets import BucketEntry, byte_view
from weightsync.checksum import Sums
from weightsync.dtypes import dtype_name
from weightsync.errors import ManifestMismatchError, WeightSyncError
from weightsync.manifest import VersionManifest
from weightsync.memo import Memo
from weightsync.regions import CopyBatch, Pair, Region
from weightsync.summed_copies import SummedCopies
from weightsync.topology_model import Box


@dataclass(frozen=True)
class TensorBox:
    """``data`` fills the box of tensor ``name`` (of ``shape``) that starts at ``start``: a
    piece of a tensor the trainer holds sharded, or the box of it this rank keeps."""

    name: str
    shape: tuple[int, ...]
    start: tuple[int, ...]
    data: torch.Tensor

    @property
    def box(self) -> Box:
        return Box(self.start, tuple(self.data.shape))


ASSEMBLE_BYTES = 256 << 20
"""Tensors assembled from boxes are loaded in groups of about this many bytes: a direct bucket
of a sharded trainer's pieces holds the whole model, which must not be assembled at once."""


def assembled(boxes: Sequence[TensorBox]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Each tensor ``boxes`` hold part of, of its whole shape, filled in its boxes only (the
    rest is never read: the boxes cover what the rank keeps), in groups of about
    :data:`ASSEMBLE_BYTES` (each group is freed once the next is asked for)."""
    by_name: dict[str, list[TensorBox]] = {}
    for b in boxes:
        by_name.setdefault(b.name, []).append(b)
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, parts in by_name.items():
        full = parts[0].data.new_empty(parts[0].shape)
        with torch.no_grad():
            for b in parts:
                full[_slices(b.box, (0,) * len(b.shape))].copy_(b.data, non_blocking=True)
        group.append((name, full))
        size += full.nbytes
        if size >= ASSEMBLE_BYTES:
            yield group
            group, size = [], 0
    if group:
        yield group


def _slices(box: Box, origin: Sequence[int]) -> tuple[slice, ...]:
    """``box`` as an index of a tensor whose first element is at ``origin``."""
    return tuple(slice(a - o, b - o) for a, b, o in zip(box.start, box.stop, origin, strict=True))


Named = Sequence[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Arrival:
    """One bucket's writes, for :meth:`WeightTarget.load`. Iterating it gives ``tensors``."""

    tensors: Named = ()
    """Complete tensors. They may be views of a reused buffer: copy what you keep."""
    boxes: Sequence[TensorBox] = ()
    """Tensors that come as boxes: the pieces of tensors a sharded trainer holds (every piece
    of a tensor in one arrival), or the box of each this rank keeps (:meth:`WeightTarget.keeps`)."""
    chunks: Sequence[tuple[BucketEntry, torch.Tensor]] = ()
    """Only for a target with :attr:`~WeightTarget.chunks_in_place`: chunks of tensors larger
    than a bucket, each the bytes ``entry.tensor_offset`` to ``+ entry.nbytes`` of tensor
    ``entry.name``, to write in place."""
    key: Hashable = None
    """Set when ``tensors``, ``boxes`` and ``chunks`` are views that are the same objects
    whenever the key comes again (a mapped buffer's, kept by the reader): a target may work
    out its writes once per key. None: these are not coming again."""
    replaced: bool = False
    """The views of earlier keys are not coming again (their buffer was replaced): drop what
    was kept for them, and with it the buffer."""
    bucket: torch.Tensor | None = None
    """Set when every tensor and chunk is a view of ``bucket`` and its checksum is wanted:
    the target may take it of its first ``nbytes`` in the same pass
    (:mod:`~weightsync.summed_copies`) and return the reduction
    :func:`~weightsync.checksum.row_sums` would (None: the reader reads the bucket again)."""
    nbytes: int = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)

    @staticmethod
    def of(arrival: Arrival | Iterable[tuple[str, torch.Tensor]]) -> Arrival:
        """``arrival``, or complete tensors given as ``(name, tensor)`` pairs (a bench or
        test driving a target without the core) as an arrival not coming again."""
        return arrival if isinstance(arrival, Arrival) else Arrival(tuple(arrival))

    def whole(self) -> Iterator[tuple[Named, Hashable]]:
        """Complete tensors and their key, for a target that loads only those: ``tensors``
        with ``key``, then the tensors ``boxes`` hold, each of its whole shape and filled in
        its boxes (:func:`assembled`, key None)."""
        if self.tensors or not self.boxes:
            yield self.tensors, self.key
        for group in assembled(self.boxes):
            yield group, None


KEPT_BATCHES = 256
"""Batches kept for mapped buffers' views (a bucket each, a few buffers)."""


class Batches(Memo[Hashable, "CopyBatch | SummedCopies"]):
    """Batches of copies (:class:`~weightsync.regions.CopyBatch`, or
    :class:`~weightsync.summed_copies.SummedCopies`) kept by an arrival's key, the last
    ``max_entries`` used: working one out costs about a millisecond per version for a 7B
    model's 339 tensors, on the path before the copies start, and a mapped buffer's views come
    every version. :meth:`clear` when their views are not coming again
    (:attr:`Arrival.replaced`)."""

    def __init__(self, max_entries: int = KEPT_BATCHES) -> None:
        super().__init__(max_entries)

    def run(self, key: Hashable, build: Callable[[], CopyBatch | SummedCopies]) -> Sums | None:
        """Run the batch kept for ``key`` (built on first use; None: built, run, not kept);
        returns what it returns (a summed batch's checksum reduction)."""
        return (build() if key is None else self.get(key, build)).run()

    def __len__(self) -> int:
        return len(self._values)


class WeightTarget(ABC):
    """Where received weights go: a torch module, a vLLM worker, an SGLang model runner.

    Per version the core calls ``validate`` (skipped while the manifest's tensor list and
    ``generation`` are those last accepted) and ``keeps`` -> ``begin`` -> ``load`` per bucket
    -> ``commit``; ``abort`` instead of ``commit`` when anything failed after ``begin``. All
    calls come from the thread in ``ReceiverCore.sync`` (with several senders, one at a time).
    """

    device: torch.device
    """Where bucket bytes should be mapped or copied before ``load``."""

    chunks_in_place: ClassVar[bool] = False
    """True: each chunk of a tensor larger than a bucket comes in :attr:`Arrival.chunks` as it
    arrives. False: the core reassembles the tensor (a full-size temporary) and passes it in
    :attr:`Arrival.tensors` of the bucket its last chunk came in."""

    generation: int = 0
    """Bump it when the target starts loading into another model (vLLM's draft model): the
    core then validates the next manifest again, even one equal to the last accepted."""

    @abstractmethod
    def validate(self, manifest: VersionManifest) -> None:
        """Check every name, shape and dtype against the live model before any write.

        Raises:
            NameResolutionError: a name the model lacks (the message names it).
            ManifestMismatchError: a shape or dtype differing from the live parameter.
        """

    exports: ClassVar[bool] = False
    """It can hand out what it applied (:meth:`held`): a catch-up source (``exports.py``)."""

    def held(self, name: str) -> torch.Tensor | None:
        """Tensor ``name`` of the version last committed, exactly as it arrived, for a
        catch-up: the box :meth:`keeps` declares of it (whole when none); None where it is not
        held so (an engine that processes what it loads)."""
        return None

    def write_regions(self, manifest: VersionManifest) -> Mapping[str, Sequence[Region]] | None:
        """After :meth:`validate`: where a sender on this GPU may write each tensor of
        ``manifest`` itself (protocol §4.3), by name: views of the live weights, each filling
        the box of its tensor that :meth:`keeps` declares (whole when none). Only for a target
        whose :meth:`begin` prepares nothing and whose loads are plain copies into those views;
        None (the default): it loads every bucket itself."""
        return None

    def keeps(self) -> Mapping[str, Box]:
        """After :meth:`validate`: the tensors of that manifest this rank keeps only a box of
        (an engine TP rank's shard, as its loaders slice them), declared to the sender. A
        tensor not listed is kept whole; the default keeps everything whole."""
        return {}

    @abstractmethod
    def begin(self, manifest: VersionManifest) -> None:
        """Prepare for loading (e.g. vLLM's layerwise reload setup)."""

    @abstractmethod
    def load(self, arrival: Arrival) -> Sums | None:
        """Load one bucket's :class:`Arrival`; returns the checksum reduction of
        :attr:`Arrival.bucket` where it took one, else None. A target that loads only
        complete tensors loads :meth:`Arrival.whole`."""

    @abstractmethod
    def commit(self, manifest: VersionManifest) -> None:
        """Post-load processing, once, after the last bucket (register LoRA, flush caches)."""

    @abstractmethod
    def abort(self, manifest: VersionManifest, error: WeightSyncError) -> None:
        """The version failed after ``begin``; leave the engine usable (weights may be dirty)."""


class InPlaceTarget(WeightTarget):
    """A target where every received tensor has one live tensor of the same shape and dtype,
    written in place (a torch module, the bench's engine-like model): no per-version setup,
    chunks written straight into their slice, a mapped buffer's copies worked out once and
    batched (:class:`Batches`), with its checksum taken in the same launch where it can."""

    chunks_in_place = True
    exports = True
    _batches: Batches | None = None
    """Set on first use (subclasses need not call ``__init__``)."""

    @abstractmethod
    def live_tensor(self, name: str) -> torch.Tensor:
        """The live tensor ``name`` is loaded into (a contiguous slice for packed names).

        Raises:
            NameResolutionError: the model has no such tensor (the message names it).
        """

    def held(self, name: str) -> torch.Tensor | None:
        kept, live = self.keeps().get(name), self.live_tensor(name)
        # As :meth:`box_copies` writes it: element i of the live tensor is element
        # ``kept.start + i`` of the tensor.
        return live if kept is None else live[tuple(slice(0, n) for n in kept.size)]

    def write_regions(self, manifest: VersionManifest) -> Mapping[str, Sequence[Region]] | None:
        """Each tensor's live view as :meth:`held` gives it, on a GPU (where a sender packing
        on the same GPU gains by writing it: its kernels and ours would take turns)."""
        if self.device.type != "cuda":
            return None
        kept = self.keeps()
        return {
            spec.name: [
                Region(
                    kept[spec.name].start if spec.name in kept else (0,) * len(spec.shape),
                    self.held(spec.name),
                )
            ]
            for spec in manifest.tensors
        }

    def check_shapes(self, manifest: VersionManifest) -> None:
        """Every manifest tensor against its live tensor.

        Raises:
            ManifestMismatchError: naming the first tensor whose shape or dtype differs.
        """
        for spec in manifest.tensors:
            live = self.live_tensor(spec.name)
            if tuple(live.shape) != spec.shape or live.dtype != spec.torch_dtype:
                raise ManifestMismatchError(
                    f"version {manifest.version}: tensor {spec.name!r} is {spec.shape} "
                    f"{spec.dtype} but the model holds {tuple(live.shape)} "
                    f"{dtype_name(live.dtype)}"
                )

    def begin(self, manifest: VersionManifest) -> None:
        pass

    def load(self, arrival: Arrival | Iterable[tuple[str, torch.Tensor]]) -> Sums | None:
        arrival = Arrival.of(arrival)
        if self._batches is None or arrival.replaced:
            self._batches = Batches()
        key, batches = arrival.key, self._batches
        if arrival.bucket is not None and key is not None and not arrival.boxes:

            @torch.no_grad()  # views of live parameters, as chunk writes take them
            def summed() -> CopyBatch | SummedCopies:
                pairs = self.copy_pairs(arrival.tensors)
                pairs += [
                    p for entry, data in arrival.chunks for p in self.chunk_copies(entry, data)
                ]
                return summed_copies.copies(
                    pairs, arrival.bucket, arrival.nbytes, destination=False
                )

            return batches.run(("summed", key), summed)
        if arrival.tensors or not arrival.boxes:
            batches.run(key, lambda: self.copies(arrival.tensors, reused=key is not None))
        if arrival.boxes:
            # Each box straight into its part of the live tensor (no whole tensor assembled).
            copies = (pair for b in arrival.boxes for pair in self.box_copies(b))
            batches.run(
                None if key is None else ("boxes", key),
                lambda: CopyBatch.of(copies, reused=key is not None),
            )
        with torch.no_grad():
            for entry, data in arrival.chunks:
                for live, chunk in self.chunk_copies(entry, data):
                    live.copy_(chunk, non_blocking=True)
        return None

    def box_copies(self, piece: TensorBox) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The copy that writes what this rank keeps of ``piece`` (none when it keeps none of
        it): ``live_tensor`` holds the box :meth:`keeps` declares (default: all of it)."""
        kept = self.keeps().get(piece.name)
        have = piece.box if kept is None else piece.box.intersect(kept)
        if have is None:
            return []
        live = self.live_tensor(piece.name)
        if have.size == live.shape == piece.data.shape:  # all of it, all it keeps: no views
            return [(live, piece.data)]
        origin = (0,) * len(piece.shape) if kept is None else kept.start
        return [(live[_slices(have, origin)], piece.data[_slices(have, piece.start)])]

    def copies(self, tensors: Named, *, reused: bool = True) -> CopyBatch:
        """The copies that load ``tensors``, batched (:class:`~weightsync.regions.CopyBatch`):
        not a launch each for thousands of MoE experts. ``reused``: kept and run again."""
        return CopyBatch.of(self.copy_pairs(tensors), reused=reused)

    def copy_pairs(self, tensors: Named) -> list[Pair]:
        """The ``(live, received)`` copies that load ``tensors`` (default: each whole into
        its :meth:`live_tensor`)."""
        return [(self.live_tensor(name), tensor) for name, tensor in tensors]

    def chunk_copies(self, entry: BucketEntry, data: torch.Tensor) -> list[Pair]:
        """The ``(live, received)`` copies that write chunk ``data`` of ``entry`` (default:
        its bytes of the :meth:`live_tensor`)."""
        live = byte_view(self.live_tensor(entry.name).data)
        return [(live[entry.tensor_offset : entry.tensor_offset + entry.nbytes], data)]

    def commit(self, manifest: VersionManifest) -> None:
        pass

    def abort(self, manifest: VersionManifest, error: WeightSyncError) -> None:
        pass
