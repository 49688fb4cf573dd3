"""``WeightTarget``: what an engine adapter implements; the receiver core drives it per version."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from weightsync import summed_copies
from weightsync.buckets import BucketEntry, byte_view
from weightsync.dtypes import dtype_name
from weightsync.errors import ManifestMismatchError, WeightSyncError
from weightsync.manifest import VersionManifest
from weightsync.regions import CopyBatch, Pair
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


class WeightTarget(ABC):
    """Where received weights go: a torch module, a vLLM worker, an SGLang model runner.

    Per version the core calls ``validate`` (skipped while the manifest's tensor list and
    ``generation`` are those last accepted) -> ``begin`` -> per bucket ``load``, then
    ``load_chunk`` for each chunk when ``chunks_in_place`` -> ``commit``; ``abort`` instead of
    ``commit`` when anything failed after ``begin``. All calls come from the thread in
    ``ReceiverCore.sync``.
    """

    device: torch.device
    """Where bucket bytes should be mapped or copied before ``load``."""

    chunks_in_place: ClassVar[bool] = False
    """True: each chunk of a tensor larger than a bucket goes to ``load_chunk`` as it arrives.
    False: the core reassembles the tensor (a full-size temporary) and passes it to ``load``
    with the rest of the bucket its last chunk came in."""

    generation: int = 0
    """Bump it when the target starts loading into another model (vLLM's draft model): the
    core then validates the next manifest again, even one equal to the last accepted."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.chunks_in_place and cls.load_chunk is WeightTarget.load_chunk:
            raise TypeError(f"{cls.__name__} sets chunks_in_place but defines no load_chunk")

    @abstractmethod
    def validate(self, manifest: VersionManifest) -> None:
        """Check every name, shape and dtype against the live model before any write.

        Raises:
            NameResolutionError: a name the model lacks (the message names it).
            ManifestMismatchError: a shape or dtype differing from the live parameter.
        """

    def kept(self) -> Mapping[str, Box]:
        """After :meth:`validate`: the tensors of that manifest this rank keeps only a box of
        (an engine TP rank's shard, as its loaders slice them), declared to the sender. A
        tensor not listed is kept whole; the default keeps everything whole."""
        return {}

    @abstractmethod
    def begin(self, manifest: VersionManifest) -> None:
        """Prepare for loading (e.g. vLLM's layerwise reload setup)."""

    @abstractmethod
    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load complete tensors. They may be views of a reused buffer: copy what you keep."""

    def load_views(self, key: Hashable, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """:meth:`load` of views that are the same objects whenever ``key`` comes again (a
        mapped buffer's views, kept by the reader): a target may work out its writes once per
        key. The default loads them."""
        self.load(tensors)

    def load_summed(
        self,
        key: Hashable,
        tensors: Sequence[tuple[str, torch.Tensor]],
        chunks: Sequence[tuple[BucketEntry, torch.Tensor]],
        bucket: torch.Tensor,
        nbytes: int,
    ) -> torch.Tensor | None:
        """:meth:`load_views` and :meth:`load_chunk` of views of ``bucket``, also taking the
        checksum of its first ``nbytes`` where the target's copies can
        (:mod:`~weightsync.summed_copies`): returns the reduction
        :func:`~weightsync.checksum.row_sums` would, or None (the reader then reads the bucket
        again for it). The default loads them and returns None."""
        self.load_views(key, tensors)
        for entry, data in chunks:
            self.load_chunk(entry, data)
        return None

    def load_boxes(self, key: Hashable, boxes: Sequence[TensorBox]) -> None:
        """Load tensors that come as boxes: the pieces of tensors a sharded trainer holds
        (every piece of a tensor in one call), or the box of each this rank keeps. ``key`` as
        for :meth:`load_views` (None: these are not coming again). The default loads each
        tensor whole, filled in its boxes (:func:`assembled`)."""
        for group in assembled(boxes):
            self.load(group)

    def forget_views(self) -> None:
        """The views :meth:`load_views` had are not coming again (their buffer was replaced):
        drop what was kept for them, and with it the buffer. The default keeps nothing."""
        return

    def load_chunk(self, entry: BucketEntry, data: torch.Tensor) -> None:
        """Write ``data``, the bytes ``entry.tensor_offset`` to ``+ entry.nbytes`` of tensor
        ``entry.name``, in place. Called only when ``chunks_in_place``; ``data`` is a view of a
        reused buffer."""
        raise NotImplementedError(f"{type(self).__name__} does not write chunks in place")

    @abstractmethod
    def commit(self, manifest: VersionManifest) -> None:
        """Post-load processing, once, after the last bucket (register LoRA, flush caches)."""

    @abstractmethod
    def abort(self, manifest: VersionManifest, error: WeightSyncError) -> None:
        """The version failed after ``begin``; leave the engine usable (weights may be dirty)."""


class InPlaceTarget(WeightTarget):
    """A target where every received tensor has one live tensor of the same shape and dtype,
    written in place (a torch module, the bench's engine-like model): no per-version setup,
    chunks written straight into their slice."""

    chunks_in_place = True
    _MAX_BATCHES = 256
    _batches: dict[Hashable, CopyBatch | SummedCopies] | None = None
    """The copies of :meth:`load_views`, :meth:`load_boxes` and :meth:`load_summed` by key
    (set on first use)."""

    @abstractmethod
    def live_tensor(self, name: str) -> torch.Tensor:
        """The live tensor ``name`` is loaded into (a contiguous slice for packed names).

        Raises:
            NameResolutionError: the model has no such tensor (the message names it).
        """

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

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.copies(tensors, reused=False).run()

    def load_views(self, key: Hashable, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        # Working out the batch costs about a millisecond per version for a 7B model's 339
        # tensors, on the path before the copies start: once per bucket of mapped views. A
        # load replaced (by a subclass or on the instance, to wrap or watch it) keeps getting
        # every call.
        if not self._copies_load():
            return self.load(tensors)
        self._batch(key, lambda: self.copies(tensors)).run()

    def load_summed(
        self,
        key: Hashable,
        tensors: Sequence[tuple[str, torch.Tensor]],
        chunks: Sequence[tuple[BucketEntry, torch.Tensor]],
        bucket: torch.Tensor,
        nbytes: int,
    ) -> torch.Tensor | None:
        own_chunks = type(self).load_chunk is InPlaceTarget.load_chunk
        if not self._copies_load() or (chunks and not own_chunks):
            return super().load_summed(key, tensors, chunks, bucket, nbytes)

        @torch.no_grad()  # views of live parameters, as load_chunk takes them
        def build() -> CopyBatch | SummedCopies:
            pairs = self.copy_pairs(tensors)
            pairs += [pair for entry, data in chunks for pair in self.chunk_copies(entry, data)]
            return summed_copies.copies(pairs, bucket, nbytes, destination=False)

        return self._batch(("summed", key), build).run()

    def load_boxes(self, key: Hashable, boxes: Sequence[TensorBox]) -> None:
        """Each box straight into its part of the live tensor (no whole tensor assembled)."""
        if not self._copies_load():
            return super().load_boxes(key, boxes)
        copies = (pair for b in boxes for pair in self.box_copies(b))
        self._batch(
            None if key is None else ("boxes", key),
            lambda: CopyBatch.of(copies, reused=key is not None),
        ).run()

    def box_copies(self, piece: TensorBox) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The copy that writes what this rank keeps of ``piece`` (none when it keeps none of
        it): ``live_tensor`` holds the box :meth:`kept` declares (default: all of it)."""
        kept = self.kept().get(piece.name)
        have = piece.box if kept is None else piece.box.intersect(kept)
        if have is None:
            return []
        live = self.live_tensor(piece.name)
        if have.size == live.shape == piece.data.shape:  # all of it, all it keeps: no views
            return [(live, piece.data)]
        origin = (0,) * len(piece.shape) if kept is None else kept.start
        return [(live[_slices(have, origin)], piece.data[_slices(have, piece.start)])]

    def _copies_load(self) -> bool:
        return getattr(self.load, "__func__", None) is InPlaceTarget.load

    def _batch(
        self, key: Hashable, build: Callable[[], CopyBatch | SummedCopies]
    ) -> CopyBatch | SummedCopies:
        """The batch kept for ``key`` (built on first use; None: built, not kept)."""
        if key is None:
            return build()
        if self._batches is None:
            self._batches = {}
        batch = self._batches.get(key)
        if batch is None:
            if len(self._batches) >= self._MAX_BATCHES:
                self._batches.clear()
            batch = self._batches[key] = build()
        return batch

    def forget_views(self) -> None:
        self._batches = None

    def copies(
        self, tensors: Sequence[tuple[str, torch.Tensor]], *, reused: bool = True
    ) -> CopyBatch:
        """The copies that load ``tensors``, batched (:class:`~weightsync.regions.CopyBatch`):
        not a launch each for thousands of MoE experts. ``reused``: kept and run again."""
        return CopyBatch.of(self.copy_pairs(tensors), reused=reused)

    def copy_pairs(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> list[Pair]:
        """The ``(live, received)`` copies that load ``tensors`` (default: each whole into
        its :meth:`live_tensor`)."""
        return [(self.live_tensor(name), tensor) for name, tensor in tensors]

    def load_chunk(self, entry: BucketEntry, data: torch.Tensor) -> None:
        with torch.no_grad():
            for live, chunk in self.chunk_copies(entry, data):
                live.copy_(chunk, non_blocking=True)

    def chunk_copies(self, entry: BucketEntry, data: torch.Tensor) -> list[Pair]:
        """The ``(live, received)`` copies that write chunk ``data`` of ``entry`` (default:
        its bytes of the :meth:`live_tensor`)."""
        live = byte_view(self.live_tensor(entry.name).data)
        return [(live[entry.tensor_offset : entry.tensor_offset + entry.nbytes], data)]

    def commit(self, manifest: VersionManifest) -> None:
        pass

    def abort(self, manifest: VersionManifest, error: WeightSyncError) -> None:
        pass
