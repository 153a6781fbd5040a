"""The plain PyTorch path: Pillow decodes in a thread pool, batches come out as tensors.

::

    Loader.get() ──► prepare(): headers, crop windows (this thread, numpy, per batch)
          │                        │
          │                        ▼
          │          thread pool: decode ─► crop+resize ─► flip ─► normalize
          │                        │          (writes into the batch's arrays)
          ▼                        ▼
    in flight: up to ``decode_depth`` batches ──► ImageBatch (torch tensors, NCHW) ──► map

Epochs, resume (leaving out the batches in flight), the batch type and the
``map`` hook are shared with the DALI path: see ``_imagebatch.py``.
"""

from __future__ import annotations

import queue
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from dataferry.schema import ConfigError, DataferryError, InvalidImage

from ._types import Batch
from ._hardware import usable_cores
from ._imagebatch import ImageBatch, ImageIterator, Prepared, Undecodable, prepare, renamed_prefetch, subset
from ._transforms import EvalTransform, TargetKind, Transform, decode_mask, decode_rgb, transform_image, transform_mask

__all__ = ["TorchIterator"]


class _Job:
    __slots__ = ("prep", "futures", "images", "masks", "bad")

    def __init__(self, prep: Prepared) -> None:
        self.prep = prep
        self.futures: list[Future] = []
        self.images: Any = None
        self.masks: Any = None
        self.bad: dict[int, str] = {}  # index -> why its image failed to decode (each thread its own keys)


def _work(job: _Job, lo: int, hi: int, transform: Transform, targets: TargetKind, dataset: str) -> float:
    """Decode and transform samples ``lo:hi`` of a batch (a pool thread); the seconds it took."""
    t0 = time.monotonic()
    p = job.prep
    b = p.batch
    for i in range(lo, hi):
        what = f"dataset {dataset!r} sample {int(b.ids[i])}"
        try:
            im = decode_rgb(b.data[i], what)
        except InvalidImage as exc:
            job.bad[i] = exc.reason  # ErrorPolicy decides in the consumer's thread (_pop)
            continue
        if p.hw is not None and (im.height, im.width) != tuple(p.hw[i]):
            job.bad[i] = f"decoded {im.width}x{im.height}, header said {p.hw[i][1]}x{p.hw[i][0]}"
            continue
        mask = decode_mask(b.targets[i], what) if targets == "mask" else None
        if transform is None:
            job.images[i] = np.array(im)  # writable, for torch
            if mask is not None:
                job.masks[i] = np.array(mask)
            continue
        transform_image(im, p.windows[i], bool(p.flips[i]), transform, job.images[i])
        if mask is not None:
            job.masks[i] = transform_mask(mask, p.windows[i], bool(p.flips[i]), transform.size)
    return time.monotonic() - t0


class TorchIterator(ImageIterator):
    """Batches of ``loader``, decoded by Pillow in ``workers`` threads and
    transformed on the CPU, as :class:`ImageBatch` of torch tensors.

    ``transform``: :class:`TrainTransform`, :class:`EvalTransform` or None
    (decode only). ``targets``: ``"none"``, ``"mask"`` or ``"multilabel"``
    (see ``_transforms.py`` for the encodings). ``workers``: decode threads
    (default: the usable cores, ``_hardware.usable_cores``, at most 16; Pillow releases the GIL while it decodes
    and resizes). ``decode_depth``: batches decoded ahead of the consumer
    (``Stats.decode_depth``; ``prefetch=``, its old name, still works with a DeprecationWarning).
    ``seed`` (default: the loader's plan seed) keys the random crops and
    flips with the epoch and sample id. ``map``: a function from
    :class:`ImageBatch` to :class:`ImageBatch` applied to each batch after
    the stock transform, in the consumer's thread (``_imagebatch.py``).

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
        decode_depth: int = 2,
        seed: int | None = None,
        map: Callable[[ImageBatch], ImageBatch] | None = None,
        prefetch: int | None = None,
    ) -> None:
        super().__init__(loader, transform, targets, seed, map)
        decode_depth = renamed_prefetch(prefetch, decode_depth, "TorchIterator")
        if workers is None:  # Pillow releases the GIL while decoding: one thread per usable core
            workers = min(16, usable_cores())
        if workers < 1:
            raise ConfigError(f"workers must be >= 1, not {workers}")
        self.decode_depth = decode_depth
        self.workers = workers
        self._chunk = max(1, loader.batch_size // (2 * workers))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="dataferry-decode")
        self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        self._fifo: deque[_Job] = deque()
        self._ended = False  # the loader's epoch ended; drain the fifo, pull nothing more
        self._undecodable = Undecodable(loader)  # ErrorPolicy for samples that fail to decode

    def _begin(self, epoch) -> None:
        self._fifo.clear()  # batches of an abandoned epoch
        self._ended = False
        super()._begin(epoch)

    def _next(self) -> ImageBatch:
        if self._finalizer.alive is False:
            raise DataferryError("iterator is closed")
        return super()._next()

    def _next_decoded(self) -> ImageBatch:
        self._fill(block=not self._fifo)
        if not self._fifo:
            raise StopIteration
        return self._pop()

    def _decode_gauges(self) -> tuple[int, int, int]:
        return self.workers, len(self._fifo), self.decode_depth

    def _next_nowait(self) -> ImageBatch:
        """A decoded batch if the first in line is done, else ``queue.Empty``."""
        if self._finalizer.alive is False:
            raise DataferryError("iterator is closed")
        self._fill(block=False)
        if not self._fifo:
            if self._ended:
                raise StopIteration
            raise queue.Empty
        if not all(f.done() for f in self._fifo[0].futures):
            raise queue.Empty
        return self._pop()

    def _pop(self) -> ImageBatch:
        job = self._fifo[0]
        busy = 0.0
        for f in job.futures:
            busy += f.result()  # raises the first decode error, naming the sample
        self.loader.record_decode(busy=busy)
        self._fifo.popleft()
        self._fill(block=False)
        prep = job.prep
        if job.bad:  # raises UndecodableSample, or leaves them out (ErrorPolicy skip)
            keep = self._undecodable(prep.batch, job.bad)
            prep = subset(prep, keep)
            k = keep.tolist()
            if self.transform is None:
                job.images = [job.images[i] for i in k]
                job.masks = None if job.masks is None else [job.masks[i] for i in k]
            else:
                job.images = job.images[keep]
                job.masks = None if job.masks is None else job.masks[keep]
        torch = self._torch
        if self.transform is None:
            images = [torch.from_numpy(a) for a in job.images]
            masks = None if job.masks is None else [torch.from_numpy(a) for a in job.masks]
        else:
            images = torch.from_numpy(job.images)
            masks = None if job.masks is None else torch.from_numpy(job.masks)
        return self._deliver(prep, images, masks)

    def _fill(self, *, block: bool) -> None:
        while not self._ended and len(self._fifo) < self.decode_depth:
            try:
                batch = self._epoch.get() if block else self._epoch.get_nowait()
            except StopIteration:
                self._ended = True
                return
            except queue.Empty:
                return
            self._fifo.append(self._submit(batch))
            block = False

    def _submit(self, batch: Batch) -> _Job:
        prep = prepare(batch, self.transform, self.targets, self.loader.dataset, self.seed, self._undecodable)
        job = _Job(prep)
        n = len(prep.batch)  # less any sample whose header did not parse (ErrorPolicy skip)
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
    def _in_flight(self) -> list[Batch]:
        return [j.prep.batch for j in self._fifo]

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._epoch = None  # the next iteration starts the restored epoch

    def close(self) -> None:
        """Stop the decode threads (not the loader). Idempotent."""
        self._fifo.clear()
        self._finalizer()
