"""What the PyTorch and the DALI iterators share: the batch type, the work before
decoding, epochs, resume and the ``map`` hook; neither iterator imports the other.

:func:`prepare` reads headers, draws crop windows and checks targets in the consumer's
thread (numpy) before either decoder. The batches a decoder holds are *in flight*:
:meth:`ImageIterator.state_dict` leaves them out, so a resume delivers them again. Epochs
follow the loader; the last batch is as short as the loader's. ``map`` (ImageBatch ->
ImageBatch) runs on every batch as it is handed out, in the consumer's thread; a batch
counts as delivered once decoded. :class:`Undecodable` is the ``ErrorPolicy`` for a sample
that fails to decode. torch is imported when an iterator is made, never by ``import
dataferry.client``. The flow: client/README.md ("What both iterators share").
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dataferry.schema import InvalidImage, UndecodableSample
from dataferry.schema import ConfigError, DataferryError

from ._elastic import DealtPlan, dealt_of, gather
from ._types import Batch
from ._transforms import (
    EvalTransform,
    TargetKind,
    Transform,
    TrainTransform,
    check_mask,
    check_targets,
    crop_windows,
    decode_multilabel,
    image_size,
)

__all__ = ["ImageBatch", "ImageIterator", "Prepared", "prepare", "state_without", "import_torch", "Undecodable",
           "subset", "renamed_prefetch"]

log = logging.getLogger("dataferry.client")


def renamed_prefetch(prefetch: int | None, decode_depth: int, owner: str, stacklevel: int = 3) -> int:
    """The batches decoded ahead of the consumer, checked: ``decode_depth``, or ``prefetch``, its
    old name (a DeprecationWarning: "prefetch" is the loader's ``Prefetch``)."""
    if prefetch is not None:
        warnings.warn(f"{owner}(prefetch=) is now decode_depth=", DeprecationWarning, stacklevel=stacklevel)
        decode_depth = prefetch
    if decode_depth < 1:
        raise ConfigError(f"decode_depth (batches decoded ahead; was prefetch) must be >= 1, not {decode_depth}")
    return decode_depth


def import_torch():
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            "this needs PyTorch: pip install torch==2.13.0 (or your own build), "
            "then pip install 'dataferry[torch]'"
        ) from exc
    return torch


@dataclass(eq=False)
class ImageBatch:
    """One batch as tensors, the same from the DALI and the PyTorch paths.

    ``images``: float32 ``[N, 3, S, S]`` (normalized, NCHW); with
    ``transform=None``, a list of uint8 ``[H, W, 3]`` tensors. ``labels`` and
    ``ids``: int64 ``[N]``. ``targets``: None, masks uint8 ``[N, S, S]`` (a
    list of ``[H, W]`` without a transform), or multilabel float32
    ``[N, num_classes]``. Images and masks are on the decoding device (the
    GPU for DALI's mixed decoder); ids, labels and multilabel targets on the
    CPU: :meth:`to` moves all of it. A ``map`` makes a new one with
    ``dataclasses.replace(batch, images=...)``.
    """

    images: Any
    labels: Any
    ids: Any
    targets: Any
    epoch: int

    def __len__(self) -> int:
        return len(self.ids)

    def _map(self, fn: Callable) -> ImageBatch:
        def each(x):
            if x is None:
                return None
            return [fn(t) for t in x] if isinstance(x, list) else fn(x)

        return replace(self, images=each(self.images), labels=fn(self.labels), ids=fn(self.ids),
                       targets=each(self.targets))

    def to(self, device, non_blocking: bool = False) -> ImageBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> ImageBatch:
        """For ``DataLoader(pin_memory=True)``."""
        return self._map(lambda t: t if t.is_cuda else t.pin_memory())


def state_without(state: dict, inflight: list[Batch]) -> dict:
    """The loader's ``state`` with the positions of ``inflight`` batches
    (taken from the loader, not yet handed to the consumer) marked undelivered."""
    if not inflight:
        return state
    epochs = {b.epoch for b in inflight}
    if len(epochs) != 1:
        raise DataferryError(f"batches of several epochs in flight: {sorted(epochs)}")
    epoch = epochs.pop()
    pos = set(np.concatenate([b.positions for b in inflight]).tolist())
    if state["epoch"] == epoch:
        frontier, beyond = state["frontier"], state["beyond"]
    elif state["epoch"] == epoch + 1 and state["frontier"] == 0 and not state["beyond"]:
        frontier, beyond = state["num_samples"], []  # the loader ended that epoch: these are its tail
    else:
        raise DataferryError(f"loader is at epoch {state['epoch']}, batches in flight are from epoch {epoch}")
    low = min(min(pos), frontier)
    done = (set(range(low, frontier)) | set(beyond)) - pos
    return dict(state, epoch=epoch, frontier=low, beyond=sorted(done))


@dataclass(eq=False)
class Prepared:
    """A loader batch plus what both paths compute before decoding."""

    batch: Batch
    windows: np.ndarray | None  # int32 [N, 4]: x, y, w, h
    flips: np.ndarray | None  # bool [N]
    hw: np.ndarray | None  # int64 [N, 2]
    multilabel: np.ndarray | None  # float32 [N, K]


class Undecodable:
    """``ErrorPolicy`` for samples an iterator cannot decode, shared by both iterators:
    raise :class:`UndecodableSample` (naming the dataset and id), or leave the sample out
    of its batch and count it (``Stats.undecodable``), at most ``max_skipped`` an epoch
    (counted apart from the loader's skips). Runs in the consumer's thread."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self._epoch: int | None = None
        self._count = 0

    def __call__(self, batch: Batch, bad: dict[int, str]) -> np.ndarray:
        """The indexes of ``batch`` to keep, ``bad`` (index -> reason) left out; or raise."""
        loader = self.loader
        policy, dataset = loader.errors, loader.dataset
        if batch.epoch != self._epoch:
            self._epoch, self._count = batch.epoch, 0
        for i in sorted(bad):
            sid = int(batch.ids[i])
            err = UndecodableSample(dataset, sid, bad[i])
            if policy.on_error == "raise" or self._count >= policy.max_skipped:
                raise err
            self._count += 1
            loader.record_undecodable(sid)
            log.warning("%s; left out (ErrorPolicy skip)", err)
        return np.array([i for i in range(len(batch)) if i not in bad], np.intp)


def _pick(b: Batch, keep: np.ndarray) -> Batch:
    """``b`` with only the samples at ``keep`` (the others' positions count as delivered)."""
    k = keep.tolist()
    return replace(b, ids=b.ids[keep], labels=b.labels[keep], data=[b.data[i] for i in k],
                   targets=None if b.targets is None else [b.targets[i] for i in k], positions=b.positions[keep])


def subset(prep: Prepared, keep: np.ndarray) -> Prepared:
    """``prep`` with only the samples at ``keep``."""
    pick = (lambda a: None if a is None else a[keep])
    return Prepared(_pick(prep.batch, keep), pick(prep.windows), pick(prep.flips), pick(prep.hw),
                    pick(prep.multilabel))


def _sizes(batch: Batch, what: list[str], on_bad: Callable[[Batch, dict[int, str]], np.ndarray] | None):
    """The batch's image sizes from their headers; a header that does not parse goes to ``on_bad``
    (which raises, or says which to keep: then the batch without them)."""
    sizes, bad = [], {}
    for i, (d, w) in enumerate(zip(batch.data, what)):
        try:
            sizes.append(image_size(d, w))
        except InvalidImage as exc:
            if on_bad is None:
                raise
            bad[i] = exc.reason
            sizes.append((1, 1))
    hw = np.array(sizes, np.int64).reshape(-1, 2)
    if not bad:
        return batch, what, hw
    keep = on_bad(batch, bad)
    return _pick(batch, keep), [what[i] for i in keep.tolist()], hw[keep]


def prepare(batch: Batch, transform: Transform, targets: TargetKind, dataset: str, seed: int,
            on_bad: Callable[[Batch, dict[int, str]], np.ndarray] | None = None) -> Prepared:
    """Read headers, draw crop windows, check and decode targets (this thread, cheap).

    With ``on_bad`` (an :class:`Undecodable`), every image header is read, and a sample
    whose header does not parse is handed to it before anything is decoded."""
    what = [f"dataset {dataset!r} sample {i}" for i in batch.ids.tolist()]
    hw = windows = flips = multilabel = None
    if transform is not None or targets == "mask" or on_bad is not None:
        batch, what, hw = _sizes(batch, what, on_bad)
    if transform is not None:
        windows, flips = crop_windows(transform, hw, batch.ids, seed=seed, epoch=batch.epoch)
    if targets == "mask":
        blobs = batch.targets or [None] * len(batch)
        for blob, size, w in zip(blobs, hw, what):
            if blob is None:
                raise DataferryError(f"{w}: no mask target (targets='mask')")
            check_mask(blob, tuple(size), w)
    elif targets == "multilabel":
        multilabel = decode_multilabel(batch.targets or [None] * len(batch), batch.ids.tolist(), dataset)
    return Prepared(batch, windows, flips, hw, multilabel)


class ImageIterator:
    """The part of :class:`TorchIterator` and :class:`DaliIterator` that does
    not depend on the decoder: options, the batch handed out, resume, lifetime.

    A subclass takes batches from ``self.loader``, :func:`prepare` s them,
    decodes, and returns ``self._deliver(prep, images, masks)`` from
    :meth:`_next_decoded`; :meth:`_decode_gauges` reports its decode threads and
    queue; :meth:`_in_flight` lists the loader batches it holds.
    """

    def __init__(self, loader, transform: Transform, targets: TargetKind, seed: int | None,
                 map: Callable[[ImageBatch], ImageBatch] | None) -> None:
        torch = import_torch()
        _register_dataset(torch)
        check_targets(targets)
        if transform is not None and not isinstance(transform, (TrainTransform, EvalTransform)):
            raise ConfigError(f"transform must be a TrainTransform, an EvalTransform or None, not {transform!r}")
        if map is not None and not callable(map):
            raise ConfigError(f"map must be a function from ImageBatch to ImageBatch, not {map!r}")
        self.loader, self.transform, self.targets, self.map = loader, transform, targets, map
        self.seed = loader.plan_options.seed if seed is None else seed
        self._torch = torch
        self._epoch = None  # the LoaderEpoch batches are taken from
        self._bare_done = False  # next() without iter() ran an epoch to its end

    def _in_flight(self) -> list[Batch]:
        raise NotImplementedError

    def _deliver(self, prep: Prepared, images, masks) -> ImageBatch:
        """The :class:`ImageBatch` of a decoded batch, through ``map``."""
        torch, b = self._torch, prep.batch
        targets = masks if prep.multilabel is None else torch.from_numpy(prep.multilabel)
        out = ImageBatch(images=images, labels=torch.from_numpy(b.labels.astype(np.int64)),
                         ids=torch.from_numpy(b.ids.copy()), targets=targets, epoch=b.epoch)
        if self.map is None:
            return out
        try:
            out = self.map(out)
        except Exception as exc:
            exc.add_note(f"in map={self.map!r} on a batch of dataset {self.loader.dataset!r}, epoch {b.epoch}, "
                         f"first ids {b.ids[:4].tolist()}")
            raise
        if not isinstance(out, ImageBatch):
            raise ConfigError(f"map={self.map!r} returned {type(out).__name__}, not an ImageBatch")
        return out

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> ImageEpoch:
        """A fresh iterator over the loader's next epoch (see :class:`ImageEpoch`)."""
        return ImageEpoch(self, iter(self.loader))

    def __next__(self) -> ImageBatch:
        """The next batch of the epoch begun last (the loader's running one if none)."""
        if self._epoch is None or self._bare_done:
            self._bare_done = False
            self._begin(iter(self.loader))
        try:
            return self._next()
        except StopIteration:
            self._bare_done = True  # the next next() begins the next epoch
            raise

    def _begin(self, epoch) -> None:
        """Start taking batches from ``epoch`` (a :class:`LoaderEpoch`)."""
        self._epoch = epoch

    def _next(self) -> ImageBatch:
        """The next batch (blocking). The training loop's time in here beyond
        its wait on the loader (the feeder's, counted by the loader) is its
        wait on decode; the decode gauges are updated as of the end."""
        loader = self.loader
        t0, waited = time.monotonic(), loader.waited
        try:
            return self._next_decoded()
        finally:
            loader.record_decode(wait=max(0.0, time.monotonic() - t0 - (loader.waited - waited)),
                                 gauges=self._decode_gauges())

    def _next_decoded(self) -> ImageBatch:
        """The next decoded batch, blocking; StopIteration at the epoch's end."""
        raise NotImplementedError

    def _decode_gauges(self) -> tuple[int, int, int]:
        """``(decode threads, batches in the decode queue, its capacity)``."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The loader's state, less the batches in flight here (exact resume)."""
        local = getattr(self.loader, "_local_state", None)  # a Loader: gathered after taking the in-flight out
        if local is None:
            return state_without(self.loader.state_dict(), self._in_flight())
        inflight, plan = self._in_flight(), getattr(self.loader, "_plan", None)  # the plan before local() moves on
        state = local()
        if inflight and isinstance(plan, DealtPlan) and state["epoch"] == plan.epoch + 1 \
                and all(b.epoch == plan.epoch for b in inflight):
            state = dict(state, num_samples=len(plan), **dealt_of(plan))  # a re-dealt epoch's tail in flight here
        return gather(state_without(state, inflight))

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`; only with nothing in flight (before
        iterating, or at the end of an epoch)."""
        if self._in_flight():
            raise DataferryError(f"load_state_dict with {len(self._in_flight())} batch(es) in flight: "
                                 "call it before iterating")
        self.loader.load_state_dict(state)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


_registered = False


def _register_dataset(torch) -> None:
    """Make every :class:`ImageIterator` a ``torch.utils.data.IterableDataset``
    (an ABC) without importing torch when this module is imported."""
    global _registered
    if not _registered:
        torch.utils.data.IterableDataset.register(ImageIterator)
        _registered = True


class ImageEpoch:
    """One epoch of a :class:`TorchIterator` or :class:`DaliIterator` (what
    ``iter(it)`` returns), as :class:`LoaderEpoch` is for the loader: each
    ``iter(it)`` walks the next epoch; it stops at the epoch's end and stays
    stopped; taking from a later epoch's iterator abandons this one's rest."""

    __slots__ = ("_owner", "_epoch", "_done")

    def __init__(self, owner: ImageIterator, epoch) -> None:
        self._owner, self._epoch, self._done = owner, epoch, False

    @property
    def epoch(self) -> int:
        return self._epoch.epoch

    def __iter__(self) -> ImageEpoch:
        return self

    def _switch(self) -> ImageIterator:
        owner = self._owner
        if not self._done and owner._epoch is not self._epoch:
            if self._epoch.epoch < owner.loader.epoch:
                self._done = True  # the loader is past this epoch
            else:
                owner._begin(self._epoch)  # the owner's earlier epoch, if unfinished, is abandoned
        if self._done:
            raise StopIteration
        return owner

    def _take(self, nowait: bool) -> ImageBatch:
        try:
            owner = self._switch()
            return owner._next_nowait() if nowait else owner._next()
        except StopIteration:
            self._done = True
            raise

    def __next__(self) -> ImageBatch:
        return self._take(False)

    def get_nowait(self) -> ImageBatch:
        """The next decoded batch if one is ready, else ``queue.Empty``."""
        return self._take(True)

    def __len__(self) -> int:
        return len(self._owner)
