"""Ingest: a folder or manifest of images in, committed samples out.

``scan -> ids -> store.existing -> validate (process pool) -> store.put_samples
-> the all split and the dataset row``. Memory stays bounded: a few
validation chunks and write batches in flight, never the dataset. A sample is
committed by its batch's ``put_samples``; the ``all`` split and the dataset
row are written at the end, merged with what was there, so a re-run skips
what is committed and finishes an interrupted ingest. Bad files are reported
with a reason and never written; a source with no images is refused before
anything is written; a failed write (a full disk) stops the ingest, keeping
the batches committed before it.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import os
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import numpy as np

from .._errors import ConfigError, DataferryError, DatasetNotFound, IntegrityError, InvalidImage, NotFound
from .._errors import StoreError, StoreTimeout, StoreUnavailable
from .._model import ALL_SPLIT, DatasetInfo, IdList, Sample, SampleMeta, check_name, sample_id
from .._scan import Source, SourceFile, require_images, scan
from .._store import SampleRecord, Store
from .._validate import DEFAULT_MAX_PIXELS, ValidatedFile, ValidateOptions, validate_chunk, validator_pool

__all__ = ["IngestOptions", "IngestReport", "ingest"]

_EXISTING_BATCH = 4096  # ids per store.existing call
_CHUNK = 8  # files per validation task sent to a worker process


@dataclass(frozen=True, slots=True)
class IngestOptions:
    """How to ingest. ``format=None`` stores the original bytes."""

    format: str | None = None  # "jpeg" | "png" to re-encode
    quality: int = 90
    max_side: int | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS  # decompression-bomb limit
    workers: int | None = None  # validation processes; None: os.cpu_count()
    allow_rejects: bool = False  # whether rejected files still make the ingest "ok"
    batch_size: int = 64  # samples per put_samples call
    max_inflight: int = 4  # put_samples batches in flight at once

    def __post_init__(self) -> None:
        self.validation  # validates format, quality, max_side, max_pixels
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"workers must be at least 1, got {self.workers}")
        if self.batch_size < 1 or self.max_inflight < 1:
            raise ConfigError(f"batch_size and max_inflight must be positive, got {self.batch_size}, {self.max_inflight}")

    @property
    def validation(self) -> ValidateOptions:
        return ValidateOptions(self.format, self.quality, self.max_side, self.max_pixels)


@dataclass(frozen=True)
class IngestReport:
    dataset: str
    source: str
    ingested: int
    already_present: int
    rejected: tuple[tuple[str, str], ...]  # (relpath, reason), sorted
    skipped: tuple[str, ...]  # non-image files, never read
    bytes_in: int  # source bytes of the ingested files
    bytes_out: int  # stored bytes of the ingested files
    elapsed: float
    num_samples: int  # the dataset's size afterwards (its ``all`` split)
    allow_rejects: bool = field(default=False, repr=False)

    @property
    def ok(self) -> bool:
        return not self.rejected or self.allow_rejects

    @property
    def images_per_s(self) -> float:
        return self.ingested / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes_in / 1e6 / self.elapsed if self.elapsed > 0 else 0.0

    def summary(self) -> str:
        lines = [
            f"dataset {self.dataset!r} from {self.source}: {self.num_samples} samples",
            f"  ingested         {self.ingested}"
            + (f"  ({self.bytes_in / 1e6:.1f} MB in, {self.bytes_out / 1e6:.1f} MB stored)" if self.ingested else ""),
            f"  already present  {self.already_present}",
            f"  rejected         {len(self.rejected)}",
            f"  skipped          {len(self.skipped)} non-image files",
            f"  elapsed          {self.elapsed:.2f} s, {self.images_per_s:.0f} images/s, {self.mb_per_s:.1f} MB/s",
        ]
        lines += [f"  rejected: {path}: {reason}" for path, reason in self.rejected]
        return "\n".join(lines)


async def ingest(
    store: Store,
    source: str | os.PathLike[str] | Source,
    dataset: str,
    options: IngestOptions = IngestOptions(),
    *,
    progress: bool | None = None,
) -> IngestReport:
    """Ingest ``source`` (a folder, a manifest, or a scanned :class:`Source`).

    ``progress``: a tqdm bar on stderr; ``None`` shows it when stderr is a TTY.
    Raises ConfigError for a bad source or one with no images (nothing is
    written then), IntegrityError when ids collide or the
    dataset's label names differ from the source's; store errors pass through.
    """
    t0 = time.perf_counter()
    check_name("dataset", dataset)
    src = source if isinstance(source, Source) else await asyncio.to_thread(scan, source)
    require_images(src)  # before anything is written: an empty source is a wrong path
    files = src.files
    ids = np.fromiter((sample_id(dataset, f.relpath) for f in files), dtype=np.int64, count=len(files))
    labels = np.fromiter((f.label for f in files), dtype=np.int32, count=len(files))
    _check_unique(src, ids)
    info = await _check_labels(store, dataset, src)
    if info is None:  # record the labels first, so an interrupted ingest keeps them
        info = DatasetInfo(dataset, src.label_names, 0, _dt.datetime.now(_dt.timezone.utc))
        await store.put_dataset(info)

    committed = await _find_existing(store, dataset, src, ids, labels)
    already = int(committed.sum())
    todo = np.flatnonzero(~committed)
    stats = _Stats(rejected=list(src.unusable))
    if len(todo):
        show = sys.stderr.isatty() if progress is None else progress
        await _validate_and_write(store, dataset, src, ids, todo, committed, options, stats, show)

    num_samples = await _commit_catalog(store, info, ids[committed], labels[committed])
    return IngestReport(
        dataset=dataset,
        source=src.root,
        ingested=stats.ingested,
        already_present=already,
        rejected=tuple(sorted(stats.rejected)),
        skipped=src.skipped,
        bytes_in=stats.bytes_in,
        bytes_out=stats.bytes_out,
        elapsed=time.perf_counter() - t0,
        num_samples=num_samples,
        allow_rejects=options.allow_rejects,
    )


def _check_unique(src: Source, ids: np.ndarray) -> None:
    uniq, counts = np.unique(ids, return_counts=True)
    if len(uniq) == len(ids):
        return
    dup = int(uniq[counts > 1][0])
    paths = [f.relpath for f, i in zip(src.files, ids) if i == dup]
    raise IntegrityError(f"sample id collision in {src.root}: {paths[0]!r} and {paths[1]!r} both hash to id {dup}")


async def _check_labels(store: Store, dataset: str, src: Source) -> DatasetInfo | None:
    try:
        info = await store.get_dataset(dataset)
    except DatasetNotFound:
        return None
    if tuple(info.label_names) != src.label_names:
        raise IntegrityError(
            f"dataset {dataset!r} has labels {list(info.label_names)} but {src.root} has {list(src.label_names)}; "
            "labels must be stable: ingest into a new dataset instead"
        )
    return info


async def _patiently(read, tries: int = 3):
    """``await read()``, asked again after a timeout, up to ``tries`` times: just after a
    Cassandra node dies the others count it alive for seconds, and a coordinator waiting on it
    answers late; by the next try it is known down. Reads only: they are safe to repeat."""
    for attempt in range(1, tries + 1):
        try:
            return await read()
        except StoreTimeout:
            if attempt == tries:
                raise


async def _find_existing(store: Store, dataset: str, src: Source, ids: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """A mask of the source's samples already committed; checks their paths and labels."""
    committed = np.zeros(len(ids), dtype=bool)
    for start in range(0, len(ids), _EXISTING_BATCH):
        batch = ids[start : start + _EXISTING_BATCH].tolist()
        found = await _patiently(lambda: store.existing(dataset, batch))
        if not found:
            continue
        metas = await _patiently(lambda: store.read_meta(dataset, sorted(found)))
        for k, sid in enumerate(batch):
            if sid not in found:
                continue
            i = start + k
            meta, f = metas.get(sid), src.files[i]
            if meta is not None and meta.path != f.relpath:
                raise IntegrityError(
                    f"dataset {dataset!r}: {f.relpath!r} has sample id {sid}, already taken by {meta.path!r}"
                )
            if meta is not None and meta.label != labels[i]:
                raise IntegrityError(
                    f"dataset {dataset!r}: {f.relpath!r} is stored with label {meta.label} "
                    f"but the source now gives it label {int(labels[i])}"
                )
            committed[i] = True
    return committed


@dataclass
class _Stats:
    ingested: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    rejected: list[tuple[str, str]] = field(default_factory=list)


def _record(f: SourceFile, sid: int, vf: ValidatedFile) -> SampleRecord:
    sample = Sample(sid, f.label, vf.data, vf.target)
    meta = SampleMeta(sid, f.label, f.relpath, vf.format, vf.width, vf.height, len(vf.data), vf.sha256, dict(f.tags))
    return SampleRecord(sample, meta)


async def _validate_and_write(store, dataset, src, ids, todo, committed, options, stats, show) -> None:
    """Validate ``todo`` in worker processes and write the valid ones in batches.

    At most ``2 * workers + 2`` validation chunks and ``options.max_inflight``
    write batches are in flight; validation waits while writes lag behind.
    """
    from tqdm import tqdm

    loop = asyncio.get_running_loop()
    vopts = options.validation
    workers = options.workers or os.cpu_count() or 1
    chunks = (todo[i : i + _CHUNK] for i in range(0, len(todo), _CHUNK))
    max_chunks, bs = 2 * workers + 2, options.batch_size
    validating: dict[asyncio.Future, np.ndarray] = {}
    writing: dict[asyncio.Future, tuple[np.ndarray, int, int]] = {}
    buf: list[tuple[int, SampleRecord, int]] = []  # (index, record, bytes_in)
    exhausted = False
    bar = tqdm(total=len(todo), unit="img", file=sys.stderr, disable=not show, desc=f"ingest {dataset}", leave=False)
    pool = validator_pool(workers)
    try:
        while True:
            while not exhausted and len(validating) < max_chunks and len(buf) < bs * options.max_inflight:
                idx = next(chunks, None)
                if idx is None:
                    exhausted = True
                    break
                jobs = [(src.files[i].path, src.files[i].target) for i in idx]
                validating[loop.run_in_executor(pool, validate_chunk, jobs, vopts)] = idx
            while buf and len(writing) < options.max_inflight and (len(buf) >= bs or (exhausted and not validating)):
                batch, buf = buf[:bs], buf[bs:]
                fut = asyncio.ensure_future(store.put_samples(dataset, [r for _, r, _ in batch]))
                nbytes = (sum(b for *_, b in batch), sum(r.meta.size for _, r, _ in batch))
                writing[fut] = (np.array([i for i, _, _ in batch]), *nbytes)
            if not validating and not writing:
                break
            done, _ = await asyncio.wait([*validating, *writing], return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                if fut in writing:
                    idx, nin, nout = writing.pop(fut)
                    _written(fut, dataset, stats)
                    committed[idx] = True
                    stats.ingested += len(idx)
                    stats.bytes_in += nin
                    stats.bytes_out += nout
                    bar.update(len(idx))
                    if show:
                        bar.set_postfix_str(f"{stats.bytes_in / 1e6 / max(bar.format_dict['elapsed'], 1e-9):.1f} MB/s")
                    continue
                idx = validating.pop(fut)
                for i, res in zip(idx.tolist(), _results(fut)):
                    f = src.files[i]
                    if isinstance(res, InvalidImage):
                        stats.rejected.append((f.relpath, res.reason))
                        bar.update(1)
                    else:
                        buf.append((i, _record(f, int(ids[i]), res), res.bytes_in))
    except BaseException:
        for fut in [*validating, *writing]:
            fut.cancel()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        bar.close()
    await asyncio.to_thread(pool.shutdown, wait=True)


def _written(fut: asyncio.Future, dataset: str, stats: _Stats) -> None:
    """Raise a failed write's error, saying what this run committed before it."""
    try:
        fut.result()
    except StoreError as exc:
        cls = next(c for c in (StoreTimeout, StoreUnavailable, StoreError) if isinstance(exc, c))
        raise cls(
            f"{exc}; ingest of {dataset!r} stopped after committing {stats.ingested} new samples "
            "(kept: run the same ingest again to finish)"
        ) from exc


def _results(fut: asyncio.Future) -> list:
    try:
        return fut.result()
    except BrokenProcessPool as exc:
        raise DataferryError(
            "a validation worker process died (out of memory? or a script that starts ingest "
            "without an `if __name__ == '__main__':` guard)"
        ) from exc


async def _commit_catalog(store: Store, info: DatasetInfo, ids: np.ndarray, labels: np.ndarray) -> int:
    """Merge the committed ids into the ``all`` split; rewrite it and the dataset row if changed."""
    try:
        old = await store.read_split(info.name, ALL_SPLIT)
    except NotFound:
        old = None
    if old is not None and len(old):
        ids, labels = np.concatenate([old.ids, ids]), np.concatenate([old.labels, labels])
    uniq, first = np.unique(ids, return_index=True)
    merged = IdList(uniq, labels[first])
    if old is None or merged != old:
        await store.put_split(info.name, ALL_SPLIT, merged)
    if info.num_samples != len(merged):
        await store.put_dataset(DatasetInfo(info.name, info.label_names, len(merged), info.created))
    return len(merged)
