"""The plain PyTorch path: Pillow decodes in a thread pool, batches come out as tensors.

::

    Loader.get() ──► headers, crop windows (this thread, numpy, per batch)
          │                        │
          │                        ▼
          │          thread pool: decode ─► crop+resize ─► flip ─► normalize
          │                        │          (writes into the batch's arrays)
          ▼                        ▼
    in flight: up to ``prefetch`` batches ──► ImageBatch (torch tensors, NCHW)

:class:`ImageBatch` is also what :class:`~dataferry.client.DaliIterator`
yields, so a training loop does not care which path fed it. Epochs follow the
loader: ``for batch in it`` runs to the end of the loader's current epoch,
the next ``for`` runs the next one. Batches taken from the loader and not yet
handed out are *in flight*; :meth:`TorchIterator.state_dict` leaves them out,
so a resume delivers them again (the loader's own state would count them).

torch is imported when an iterator is made, never by ``import dataferry.client``.
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dataferry.schema._errors import ConfigError, DataferryError

from ._engine import Batch
from ._transforms import (
    EvalTransform,
    TargetKind,
    Transform,
    TrainTransform,
    check_mask,
    check_targets,
    crop_windows,
    decode_mask,
    decode_multilabel,
    decode_rgb,
    image_size,
    transform_image,
    transform_mask,
)

__all__ = ["ImageBatch", "TorchIterator", "import_torch", "state_without", "Prepared", "prepare"]


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
    CPU: :meth:`to` moves all of it.
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


def prepare(batch: Batch, transform: Transform, targets: TargetKind, dataset: str, seed: int) -> Prepared:
    """Read headers, draw crop windows, check and decode targets (this thread, cheap)."""
    what = [f"dataset {dataset!r} sample {i}" for i in batch.ids.tolist()]
    hw = windows = flips = multilabel = None
    if transform is not None or targets == "mask":
        hw = np.array([image_size(d, w) for d, w in zip(batch.data, what)], np.int64).reshape(-1, 2)
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


def to_batch(torch, prep: Prepared, images, masks) -> ImageBatch:
    b = prep.batch
    targets = masks
    if prep.multilabel is not None:
        targets = torch.from_numpy(prep.multilabel)
    return ImageBatch(
        images=images,
        labels=torch.from_numpy(b.labels.astype(np.int64)),
        ids=torch.from_numpy(b.ids.copy()),
        targets=targets,
        epoch=b.epoch,
    )


class _Job:
    __slots__ = ("prep", "futures", "images", "masks")

    def __init__(self, prep: Prepared) -> None:
        self.prep = prep
        self.futures: list[Future] = []
        self.images: Any = None
        self.masks: Any = None


def _work(job: _Job, lo: int, hi: int, transform: Transform, targets: TargetKind, dataset: str) -> None:
    """Decode and transform samples ``lo:hi`` of a batch (a pool thread)."""
    p = job.prep
    b = p.batch
    for i in range(lo, hi):
        what = f"dataset {dataset!r} sample {int(b.ids[i])}"
        im = decode_rgb(b.data[i], what)
        if p.hw is not None and (im.height, im.width) != tuple(p.hw[i]):
            raise DataferryError(f"{what}: decoded {im.width}x{im.height}, header said {p.hw[i][1]}x{p.hw[i][0]}")
        mask = decode_mask(b.targets[i], what) if targets == "mask" else None
        if transform is None:
            job.images[i] = np.array(im)  # writable, for torch
            if mask is not None:
                job.masks[i] = np.array(mask)
            continue
        transform_image(im, p.windows[i], bool(p.flips[i]), transform, job.images[i])
        if mask is not None:
            job.masks[i] = transform_mask(mask, p.windows[i], bool(p.flips[i]), transform.size)


class TorchIterator:
    """Batches of ``loader``, decoded by Pillow in ``workers`` threads and
    transformed on the CPU, as :class:`ImageBatch` of torch tensors.

    ``transform``: :class:`TrainTransform`, :class:`EvalTransform` or None
    (decode only). ``targets``: ``"none"``, ``"mask"`` or ``"multilabel"``
    (see ``_transforms.py`` for the encodings). ``workers``: decode threads
    (default ``min(16, cpu_count)``; Pillow releases the GIL while it decodes
    and resizes). ``prefetch``: batches decoded ahead of the consumer.
    ``seed`` (default: the loader's plan seed) keys the random crops and
    flips with the epoch and sample id.

    Also a ``torch.utils.data.IterableDataset``: ``DataLoader(it,
    batch_size=None, num_workers=0, pin_memory=True)`` works (decoding is
    already parallel; worker processes cannot share the loader).
    The iterator does not own the loader: close both.
    """

    def __init__(
        self,
        loader,
        transform: Transform = EvalTransform(),
        *,
        targets: TargetKind = "none",
        workers: int | None = None,
        prefetch: int = 2,
        seed: int | None = None,
    ) -> None:
        torch = import_torch()
        _register_dataset(torch)
        check_targets(targets)
        if transform is not None and not isinstance(transform, (TrainTransform, EvalTransform)):
            raise ConfigError(f"transform must be a TrainTransform, an EvalTransform or None, not {transform!r}")
        if prefetch < 1:
            raise ConfigError(f"prefetch must be >= 1, not {prefetch}")
        workers = workers or min(16, os.cpu_count() or 1)
        if workers < 1:
            raise ConfigError(f"workers must be >= 1, not {workers}")
        self.loader, self.transform, self.targets, self.prefetch = loader, transform, targets, prefetch
        self.seed = loader.plan_options.seed if seed is None else seed
        self._torch = torch
        self._chunk = max(1, loader.batch_size // (2 * workers))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="dataferry-decode")
        self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        self._fifo: deque[_Job] = deque()
        self._ended = False  # the loader's epoch ended; drain the fifo, pull nothing more

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> TorchIterator:
        return self

    def __next__(self) -> ImageBatch:
        if self._finalizer.alive is False:
            raise DataferryError("iterator is closed")
        self._fill(block=not self._fifo)
        if not self._fifo:
            self._ended = False
            raise StopIteration
        job = self._fifo[0]
        for f in job.futures:
            f.result()  # raises the first decode error, naming the sample
        self._fifo.popleft()
        self._fill(block=False)
        torch = self._torch
        if self.transform is None:
            images = [torch.from_numpy(a) for a in job.images]
            masks = None if job.masks is None else [torch.from_numpy(a) for a in job.masks]
        else:
            images = torch.from_numpy(job.images)
            masks = None if job.masks is None else torch.from_numpy(job.masks)
        return to_batch(torch, job.prep, images, masks)

    def _fill(self, *, block: bool) -> None:
        while not self._ended and len(self._fifo) < self.prefetch:
            try:
                batch = self.loader.get(timeout=None if block else 0)
            except StopIteration:
                self._ended = True
                return
            except TimeoutError as exc:
                if type(exc) is not TimeoutError:  # a store timeout, not "nothing ready yet"
                    raise
                return
            self._fifo.append(self._submit(batch))
            block = False

    def _submit(self, batch: Batch) -> _Job:
        prep = prepare(batch, self.transform, self.targets, self.loader.dataset, self.seed)
        job = _Job(prep)
        n = len(batch)
        if self.transform is None:
            job.images = [None] * n
            job.masks = [None] * n if self.targets == "mask" else None
        else:
            s = self.transform.size
            job.images = np.empty((n, 3, s, s), np.float32)
            job.masks = np.empty((n, s, s), np.uint8) if self.targets == "mask" else None
        for lo in range(0, n, self._chunk):
            hi = min(n, lo + self._chunk)
            job.futures.append(self._pool.submit(_work, job, lo, hi, self.transform, self.targets, self.loader.dataset))
        return job

    # --- resume and lifetime ---------------------------------------------------------
    def state_dict(self) -> dict:
        """The loader's state, less the batches in flight here (exact resume)."""
        return state_without(self.loader.state_dict(), [j.prep.batch for j in self._fifo])

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`; only with nothing in flight (before
        iterating, or at the end of an epoch)."""
        if self._fifo:
            raise DataferryError("load_state_dict with batches in flight: call it before iterating")
        self._ended = False
        self.loader.load_state_dict(state)

    def close(self) -> None:
        """Stop the decode threads (not the loader). Idempotent."""
        self._fifo.clear()
        self._finalizer()

    def __enter__(self) -> TorchIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_registered = False


def _register_dataset(torch) -> None:
    """Make both iterators ``IterableDataset`` s (an ABC) without importing
    torch when this module is imported."""
    global _registered
    if not _registered:
        from ._dali import DaliIterator

        torch.utils.data.IterableDataset.register(TorchIterator)
        torch.utils.data.IterableDataset.register(DaliIterator)
        _registered = True
