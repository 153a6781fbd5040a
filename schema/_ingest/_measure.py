"""Measure each storage strategy on a sample of a dataset: ``dataferry advise``'s first half.

:func:`measure` applies each candidate strategy to a reproducible sample
(:func:`choose_sample`) with ingest's own code (``validate_bytes``, in worker
processes) and measures bytes per image, encode CPU, decode rate on the
training machine's cores (and DALI's decoder when there is one) and PSNR
against the source. :func:`advise_source` samples a folder or manifest, as
``dataferry ingest`` takes, :func:`advise_dataset` a stored dataset. The
training machine's decoders come in through one seam, ``probe``
(:data:`~._advice.Probe`), which the CLI fills with the client's.
"""

from __future__ import annotations

import io
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from PIL import Image

from .._errors import ConfigError, InvalidImage
from .._model import ALL_SPLIT
from .._scan import require_images, scan
from .._validate import prepare_image, validate_bytes, validator_pool
from ._advice import Advice, AdviseOptions, Measurement, Probe, Strategy, candidates

__all__ = ["choose_sample", "measure", "advise_source", "advise_dataset"]

_LOSSLESS_FORMATS = frozenset({"PNG", "BMP", "PPM", "GIF", "TGA", "QOI", "JPEG2000"})


# --- the sample -----------------------------------------------------------------


def choose_sample(count: int, n: int, seed: int) -> list[int]:
    """``min(n, count)`` distinct indices of ``range(count)``, sorted: the same for the same arguments."""
    if count <= n:
        return list(range(count))
    rng = np.random.default_rng(seed)
    return sorted(int(i) for i in rng.choice(count, size=n, replace=False))


def _source_lossless(im: Image.Image, head: bytes) -> bool:
    fmt = im.format or ""
    if fmt == "TIFF":
        return "jpeg" not in str(im.info.get("compression", "")).lower()
    if fmt == "WEBP":
        return head.find(b"VP8L", 12) >= 0
    return fmt in _LOSSLESS_FORMATS


def _sniff(name: str, path: str | None, data: bytes | None) -> tuple[str, bool]:
    """``(PIL format, lossless)`` from the header; ``("?", False)`` when unreadable (validation says why)."""
    try:
        with (open(path, "rb") if data is None else io.BytesIO(data)) as fh:
            head = fh.read(64)
            fh.seek(0)
            with Image.open(fh) as im:
                return im.format or "?", _source_lossless(im, head)
    except Exception:  # noqa: BLE001 - a file ingest will reject; measuring reports the reason
        return "?", False


# --- measuring one image (in a worker process) -------------------------------------


@dataclass(frozen=True, slots=True)
class _Cell:
    bytes: int
    encode_s: float
    decode_s: float
    sq_err: int
    values: int
    width: int
    height: int
    blob: bytes | None  # the stored bytes, kept for the GPU measurement


@dataclass(frozen=True, slots=True)
class _ImageResult:
    name: str
    width: int
    height: int
    cells: tuple[_Cell, ...]


def _decode_rgb(data: bytes) -> Image.Image:
    """A full decode to RGB, as the client's CPU path does (``client._transforms.decode_rgb``)."""
    im = Image.open(io.BytesIO(data))
    im.load()
    return im if im.mode == "RGB" else im.convert("RGB")


def _measure_one(name: str, data: bytes, strategies: Sequence[Strategy], max_pixels: int, keep: bool) -> _ImageResult:
    cells: list[_Cell] = []
    refs: dict[int | None, np.ndarray] = {}
    source = None
    for s in strategies:
        options = replace(s.options, max_pixels=max_pixels)
        t0 = time.thread_time()
        vf = validate_bytes(name, data, options)  # InvalidImage: ingest would reject the file
        encode_s = time.thread_time() - t0
        t0 = time.thread_time()
        rgb = _decode_rgb(vf.data)
        decode_s = time.thread_time() - t0
        values = rgb.width * rgb.height * 3
        if source is None:  # after validate_bytes: the bomb limit has been checked
            source = Image.open(io.BytesIO(data))
            source.load()
            upright = source.size[::-1] if source.getexif().get(0x0112, 1) in (5, 6, 7, 8) else source.size
        size = (rgb.width, rgb.height)
        if s.format is None:  # the source's own bytes: exact by definition, and its size
            sq_err, size = 0, upright
        else:
            if s.max_side not in refs:
                refs[s.max_side] = np.asarray(prepare_image(source, "png", s.max_side).convert("RGB"))
            got, ref = np.asarray(rgb), refs[s.max_side]
            if got.shape != ref.shape:
                raise InvalidImage(name, f"{s.name} decodes to {got.shape[1]}x{got.shape[0]}, "
                                         f"the source prepared for it is {ref.shape[1]}x{ref.shape[0]}")
            diff = got.astype(np.int32) - ref
            sq_err = int(np.sum(diff * diff, dtype=np.int64))
        cells.append(_Cell(len(vf.data), encode_s, decode_s, sq_err, values, *size, vf.data if keep else None))
    return _ImageResult(name, *upright, tuple(cells))  # ingest's re-encodes are upright


def _measure_chunk(jobs: Sequence[tuple[str, str | None, bytes | None]], strategies: Sequence[Strategy],
                   max_pixels: int, keep: bool) -> list[_ImageResult | InvalidImage]:
    """Measure ``(name, path, data)`` jobs (``data`` None: read ``path``); never raises per image."""
    out: list[_ImageResult | InvalidImage] = []
    for name, path, data in jobs:
        try:
            if data is None:
                try:
                    with open(path, "rb") as fh:
                        data = fh.read()
                except OSError as exc:
                    raise InvalidImage(name, f"cannot read ({exc.strerror or exc})") from exc
            out.append(_measure_one(name, data, strategies, max_pixels, keep))
        except InvalidImage as exc:
            out.append(exc)
        except Exception as exc:  # noqa: BLE001 - a Pillow plugin choking on hostile input
            out.append(InvalidImage(name, f"cannot decode ({type(exc).__name__}: {exc})"))
    return out


# --- measuring a sample -------------------------------------------------------------


def measure(jobs: Sequence[tuple[str, str | None, bytes | None]], *, source: str, num_images: int,
            options: AdviseOptions = AdviseOptions(), probe: Probe) -> Advice:
    """Measure every candidate strategy on the sampled ``jobs`` (``(name, path, data)``), per strategy:

    * **bytes** per image, the mean over the sample;
    * **encode** time at ingest: CPU per image of ``validate_bytes`` (decode,
      check, re-encode), the work ingest spreads over its worker processes;
    * **CPU decode** rate: CPU per image of a Pillow decode to RGB (what the
      PyTorch path does per sample), times the usable cores
      (``probe``'s ``cores``): images/s when every core decodes;
    * **GPU decode** rate, when DALI sees a GPU and torch has CUDA: DALI's
      ``mixed`` decoder over the encoded sample in batches of 32, images per
      second of wall time (``probe``'s ``dali_rate``); None otherwise
      (``AdviseOptions(dali="cpu")`` runs the same pipeline on DALI's CPU
      decoder); bytes DALI cannot decode (GIF) leave the row's rate None with
      the reason in ``gpu_error``;
    * **fidelity**: PSNR in dB over the sample's pooled RGB values against the
      source's pixels as ingest prepares them (:func:`~dataferry.schema._validate.prepare_image`:
      EXIF orientation applied; for a resized strategy the source resized the
      same way), ``exact`` when every value is equal. Keeping the original bytes
      is exact by definition.

    A source is ``lossless`` when every sampled image is in a lossless format
    (PNG, BMP, PPM/PGM, GIF, lossless WebP, TIFF not JPEG-compressed, JPEG 2000:
    taken as reversible), ``lossy`` when none is, else ``mixed``; PNG and JPEG 2000
    (``jpeg2000``: lossless; nvJPEG2000 decodes it on GPUs) are candidates
    unless the source is lossy.
    """
    sniffed = [_sniff(name, path, data) for name, path, data in jobs]
    lossless = [ok for fmt, ok in sniffed if fmt != "?"]
    kind = "lossless" if lossless and all(lossless) else "lossy" if not any(lossless) else "mixed"
    strategies = candidates(kind, options.qualities, options.sides, options.resize_quality)
    machine = probe(options.dali)
    dali, cores = machine.dali, machine.cores
    results = _run_jobs(jobs, strategies, options, keep=dali is not None)
    valid = [r for r in results if isinstance(r, _ImageResult)]
    rejected = tuple((r.path, r.reason) for r in results if isinstance(r, InvalidImage))
    if not valid:
        first = f" (first: {rejected[0][0]}: {rejected[0][1]})" if rejected else ""
        raise ConfigError(f"no usable images among the {len(jobs)} sampled from {source}{first}")
    rows = []
    for k, s in enumerate(strategies):
        cells = [r.cells[k] for r in valid]
        gpu_rate, gpu_error = None, None
        if dali is not None:
            try:
                gpu_rate = machine.dali_rate([c.blob for c in cells])
            except Exception as exc:  # noqa: BLE001 - a format DALI does not decode (GIF): the row says so
                gpu_error = _first_line(exc)
        rows.append(_aggregate(s, valid, cells, cores, gpu_rate, gpu_error))
    measured = {r.name for r in valid}
    formats = Counter(fmt for (name, _, _), (fmt, _) in zip(jobs, sniffed) if name in measured)
    return Advice(source, num_images, tuple(r.name for r in valid), rejected, tuple(formats.most_common()), kind,
                  cores, dali, options.seed, tuple(rows))


def _aggregate(s: Strategy, valid: Sequence[_ImageResult], cells: Sequence[_Cell], cores: int,
               gpu_rate: float | None, gpu_error: str | None) -> Measurement:
    n = len(cells)
    decode_s = sum(c.decode_s for c in cells) / n
    sq_err, values = sum(c.sq_err for c in cells), sum(c.values for c in cells)
    psnr = math.inf if sq_err == 0 else 10 * math.log10(255.0**2 * values / sq_err)
    resized = sum((c.width, c.height) != (r.width, r.height) for c, r in zip(cells, valid))
    return Measurement(
        strategy=s, images=n, mean_bytes=sum(c.bytes for c in cells) / n,
        encode_s=sum(c.encode_s for c in cells) / n, decode_s=decode_s,
        cpu_rate=cores / max(decode_s, 1e-9), gpu_rate=gpu_rate, psnr=psnr, exact=sq_err == 0, resized=resized,
        long_in=sum(max(r.width, r.height) for r in valid) / n, long_out=sum(max(c.width, c.height) for c in cells) / n,
        gpu_error=gpu_error,
    )


def _run_jobs(jobs, strategies, options: AdviseOptions, keep: bool) -> list[_ImageResult | InvalidImage]:
    """Measure in worker processes (one per usable core by default), with a progress bar."""
    from tqdm import tqdm

    show = sys.stderr.isatty() if options.progress is None else options.progress
    bar = tqdm(total=len(jobs), unit="img", file=sys.stderr, disable=not show, desc="advise: measuring", leave=False)
    workers = min(options.workers or os.cpu_count() or 1, len(jobs))
    try:
        if workers <= 1:
            out = []
            for job in jobs:
                out += _measure_chunk([job], strategies, options.max_pixels, keep)
                bar.update(1)
            return out
        from concurrent.futures import as_completed

        size = max(1, min(8, len(jobs) // (workers * 4)))
        chunks = [jobs[i : i + size] for i in range(0, len(jobs), size)]
        done: dict[int, list] = {}
        with validator_pool(workers) as pool:
            futures = {pool.submit(_measure_chunk, c, strategies, options.max_pixels, keep): i
                       for i, c in enumerate(chunks)}
            for fut in as_completed(futures):
                done[futures[fut]] = fut.result()
                bar.update(len(chunks[futures[fut]]))
        return [r for i in range(len(chunks)) for r in done[i]]
    finally:
        bar.close()


def _first_line(exc: BaseException) -> str:
    """The line that says what went wrong: DALI's errors put it after ``encountered:``."""
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    if "encountered:" in lines and lines.index("encountered:") + 1 < len(lines):
        return lines[lines.index("encountered:") + 1][:160]
    return (lines[0] if lines else type(exc).__name__)[:160]



# --- the two sources ------------------------------------------------------------


def advise_source(src: str, options: AdviseOptions = AdviseOptions(), *, probe: Probe) -> Advice:
    """:func:`measure` a sample of an ImageFolder tree or a manifest, as ``dataferry ingest`` takes."""
    source = scan(src)
    require_images(source)
    picked = [source.files[i] for i in choose_sample(len(source.files), options.sample, options.seed)]
    jobs = [(f.relpath, f.path, None) for f in picked]
    where = source.manifest or source.root
    return measure(jobs, source=where, num_images=len(source.files), options=options, probe=probe)


async def advise_dataset(store, dataset: str, options: AdviseOptions = AdviseOptions(), *, probe: Probe) -> Advice:
    """:func:`measure` a sample of a stored dataset (its split ``all``): the bytes as stored are the original."""
    import asyncio

    await store.get_dataset(dataset)  # DatasetNotFound, naming the store
    idlist = await store.read_split(dataset, ALL_SPLIT)
    ids = [int(idlist.ids[i]) for i in choose_sample(len(idlist.ids), options.sample, options.seed)]
    if not ids:
        raise ConfigError(f"dataset {dataset!r} in {store.url} has no samples")
    meta = await store.read_meta(dataset, ids)
    data: dict[int, bytes] = {}
    async for result in store.fetch(dataset, ids):
        if not isinstance(result, Exception):
            data[result.id] = bytes(result.data)
    jobs = [(meta[i].path if i in meta else str(i), None, data[i]) for i in ids if i in data]
    where = f"dataset {dataset!r} in {store.url}"
    return await asyncio.to_thread(measure, jobs, source=where, num_images=len(idlist.ids), options=options,
                                   probe=probe)
