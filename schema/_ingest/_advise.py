"""Choose how to store a dataset by measuring it: ``dataferry advise``.

:func:`measure` applies each candidate :class:`Strategy` (the original bytes,
JPEG qualities, resized, PNG and JPEG 2000 for a lossless source) to a
reproducible sample (:func:`choose_sample`) with ingest's own code, and
measures bytes per image, encode CPU, decode rate on this machine's cores (and
DALI's GPU decoder when there is one) and PSNR against the source.
:func:`predict` turns a measurement into the full dataset's epoch over a
:class:`Link` (link- or decode-bound); :func:`recommend` picks the allowed
strategy with the shortest predicted epoch. Measuring and predicting are
separate, so one measurement answers for any link.
"""

from __future__ import annotations

import io
import math
import os
import re
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
from PIL import Image

from dataferry.schema import (
    DEFAULT_MAX_PIXELS,
    LOSSLESS,
    ConfigError,
    InvalidImage,
    ValidateOptions,
    prepare_image,
    validate_bytes,
)

__all__ = [
    "DEFAULT_MIN_PSNR", "Strategy", "candidates", "AdviseOptions", "Link", "Rules", "Measurement", "Advice",
    "Prediction", "Recommendation", "choose_sample", "measure", "advise_source", "advise_dataset", "predict",
    "recommend", "render", "ingest_command", "plot", "DecodeProbe", "Probe",
]

#: the fidelity a lossy source's strategies must keep unless ``Rules.min_psnr`` says otherwise
DEFAULT_MIN_PSNR = 38.0
#: connection, TLS, the split's id list and the first batch
SETUP_RTTS = 4
#: predicted epochs within this ratio of the shortest count as a tie (fewer bytes wins)
TIE = 1.01

_LOSSLESS_FORMATS = frozenset({"PNG", "BMP", "PPM", "GIF", "TGA", "QOI", "JPEG2000"})


class DecodeProbe(Protocol):
    """The decoders of the machine that will train, as the advisor measures them: ``cores``
    decode with Pillow; ``dali`` names what the DALI column measures (None: no column) and
    ``dali_rate`` times DALI's decoder over encoded images (images/s)."""

    cores: int
    dali: str | None

    def dali_rate(self, blobs: Sequence[bytes]) -> float: ...


#: the advisor's one seam to the client, which lives a floor above: ``probe(AdviseOptions.dali)``
#: -> this machine's :class:`DecodeProbe` (the CLI passes ``dataferry.client.decode_probe``)
Probe = Callable[[str | None], DecodeProbe]


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to store the images: ``format=None`` keeps the original bytes."""

    name: str
    format: str | None = None  # "jpeg" | "png" | "jpeg2000"
    quality: int = 90
    max_side: int | None = None

    @property
    def options(self) -> ValidateOptions:
        return ValidateOptions(format=self.format, quality=self.quality, max_side=self.max_side)

    def ingest_args(self) -> list[str]:
        """The ``dataferry ingest`` options that apply it."""
        if self.format is None:
            return []
        args = ["--format", self.format]
        if self.format not in LOSSLESS:
            args += ["--quality", str(self.quality)]
        if self.max_side is not None:
            args += ["--max-side", str(self.max_side)]
        return args


def candidates(kind: str, qualities: Sequence[int] = (95, 90, 80), sides: Sequence[int] = (512, 384, 256),
               resize_quality: int = 90) -> tuple[Strategy, ...]:
    """The strategies to measure for a ``kind`` of source (``lossless``, ``lossy``, ``mixed``)."""
    out = [Strategy("original")]
    if kind != "lossy":
        out += [Strategy("png", "png"), Strategy("jpeg2000", "jpeg2000")]
    out += [Strategy(f"jpeg q{q}", "jpeg", q) for q in sorted(set(qualities), reverse=True)]
    out += [Strategy(f"jpeg q{resize_quality} max {s}", "jpeg", resize_quality, s) for s in sorted(set(sides), reverse=True)]
    return tuple(out)


@dataclass(frozen=True, slots=True)
class AdviseOptions:
    """What to measure: ``sample`` images chosen with ``seed``; JPEG at
    ``qualities``; JPEG at ``resize_quality`` resized to ``sides``. ``workers``:
    measuring processes (default: the usable cores). ``dali``: the DALI decode
    column: None measures DALI's ``mixed`` path when a GPU is present,
    ``"gpu"`` insists on it, ``"cpu"`` measures DALI's CPU decoder instead (the
    same pipeline, for machines without a GPU), ``"off"`` never. ``progress``:
    a tqdm bar on stderr (None: when stderr is a terminal)."""

    sample: int = 200
    seed: int = 0
    qualities: tuple[int, ...] = (95, 90, 80)
    sides: tuple[int, ...] = (512, 384, 256)
    resize_quality: int = 90
    workers: int | None = None
    dali: str | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    progress: bool | None = None

    def __post_init__(self) -> None:
        if self.sample < 1:
            raise ConfigError(f"sample must be at least 1 image, got {self.sample}")
        for q in (*self.qualities, self.resize_quality):
            if not 1 <= q <= 100:
                raise ConfigError(f"JPEG quality must be 1..100, got {q}")
        for s in self.sides:
            if s < 1:
                raise ConfigError(f"a maximum side must be positive, got {s}")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"workers must be at least 1, got {self.workers}")
        if self.dali not in (None, "gpu", "cpu", "off"):
            raise ConfigError(f"dali must be None, 'gpu', 'cpu' or 'off', not {self.dali!r}")


@dataclass(frozen=True, slots=True)
class Link:
    """The link between the store and the training job: bytes/s and round trip (s)."""

    bandwidth: float = 125e6  # 1 Gbit/s
    rtt: float = 0.1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ConfigError(f"link bandwidth must be a positive, finite number of bytes/s, got {self.bandwidth}")
        if not (math.isfinite(self.rtt) and self.rtt >= 0):
            raise ConfigError(f"RTT must be a finite number of seconds >= 0, got {self.rtt}")


@dataclass(frozen=True, slots=True)
class Rules:
    """Which strategies may be recommended.

    ``min_psnr``: the fidelity a strategy must keep; None means exact for a
    lossless source and :data:`DEFAULT_MIN_PSNR` otherwise. ``max_side``:
    None keeps full resolution (a strategy that resized any sampled image is
    out); N allows strategies resized to a maximum side of N or more.
    """

    min_psnr: float | None = None
    max_side: int | None = None

    def __post_init__(self) -> None:
        if self.min_psnr is not None and not (math.isfinite(self.min_psnr) and self.min_psnr > 0):
            raise ConfigError(f"min PSNR must be a positive number of dB, got {self.min_psnr}")
        if self.max_side is not None and self.max_side < 1:
            raise ConfigError(f"max side must be positive, got {self.max_side}")


@dataclass(frozen=True, slots=True)
class Measurement:
    """One strategy measured on the sample (see module docs)."""

    strategy: Strategy
    images: int
    mean_bytes: float
    encode_s: float  # CPU seconds per image at ingest
    decode_s: float  # CPU seconds per image, Pillow decode to RGB
    cpu_rate: float  # images/s on the usable cores
    gpu_rate: float | None  # images/s of DALI's mixed decoder; None without a GPU
    psnr: float  # dB over the sample's pooled values; inf when exact
    exact: bool
    resized: int  # sampled images whose size changed
    long_in: float  # mean long side of the source
    long_out: float  # mean long side as stored
    gpu_error: str | None = None  # why DALI could not decode these bytes (gpu_rate is None then)

    @property
    def decode_rate(self) -> float:
        """The rate the training machine decodes at: the GPU's when measured, else the CPU's."""
        return self.gpu_rate if self.gpu_rate is not None else self.cpu_rate

    @property
    def full_resolution(self) -> bool:
        return self.resized == 0


@dataclass(frozen=True, slots=True)
class Advice:
    """What :func:`measure` found."""

    source: str  # the folder, manifest or stored dataset measured
    num_images: int  # in the full dataset
    sample: tuple[str, ...]  # the measured images (relative paths), in sample order
    rejected: tuple[tuple[str, str], ...]  # (path, reason) of sampled images ingest would reject
    formats: tuple[tuple[str, int], ...]  # source format -> measured images, most common first
    kind: str  # "lossless" | "lossy" | "mixed"
    cores: int
    dali: str | None  # what the DALI column measured ("NVIDIA H100 ..., mixed", "CPU"), or None
    seed: int
    rows: tuple[Measurement, ...]

    def row(self, name: str) -> Measurement:
        for m in self.rows:
            if m.strategy.name == name:
                return m
        raise KeyError(name)


@dataclass(frozen=True, slots=True)
class Prediction:
    epoch_s: float
    link_s: float  # the bytes over the bandwidth
    decode_s: float  # the images over the decode rate
    setup_s: float
    bound: str  # "link" | "decode"


@dataclass(frozen=True, slots=True)
class Recommendation:
    row: Measurement
    prediction: Prediction
    eligible: tuple[str, ...]  # the strategies the rules allowed
    reason: str


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
      source's pixels as ingest prepares them (:func:`~._validate.prepare_image`:
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

        from dataferry.schema import validator_pool

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
    from dataferry.schema import require_images, scan

    source = scan(src)
    require_images(source)
    picked = [source.files[i] for i in choose_sample(len(source.files), options.sample, options.seed)]
    jobs = [(f.relpath, f.path, None) for f in picked]
    where = source.manifest or source.root
    return measure(jobs, source=where, num_images=len(source.files), options=options, probe=probe)


async def advise_dataset(store, dataset: str, options: AdviseOptions = AdviseOptions(), *, probe: Probe) -> Advice:
    """:func:`measure` a sample of a stored dataset (its split ``all``): the bytes as stored are the original."""
    import asyncio

    from dataferry.schema import ALL_SPLIT

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


# --- predicting and recommending --------------------------------------------------


def predict(m: Measurement, num_images: int, link: Link) -> Prediction:
    """The full dataset's epoch time over ``link``.

    :func:`predict` turns a measurement into the epoch time of the full dataset
    over a :class:`Link`: ``max(N * bytes / bandwidth, N / decode rate)`` plus
    set-up, ``4 * RTT`` (connection, TLS, the split's id list, the first batch;
    after that the engine keeps enough requests in flight to hide the RTT), and
    names the bound, ``link`` or ``decode``. The decode rate is the GPU's when one
    was measured, else the CPU's. :func:`recommend` picks, among the strategies
    :class:`Rules` allow, the one with the shortest predicted epoch (within 1%:
    the fewer bytes). Measuring and predicting are separate, so one measurement
    answers for any link.
    """
    link_s = num_images * m.mean_bytes / link.bandwidth
    decode_s = num_images / m.decode_rate
    setup_s = SETUP_RTTS * link.rtt
    return Prediction(max(link_s, decode_s) + setup_s, link_s, decode_s, setup_s,
                      "link" if link_s >= decode_s else "decode")


def _allowed(m: Measurement, kind: str, rules: Rules) -> str | None:
    """None when ``rules`` allow ``m``, else why not."""
    if not m.full_resolution:
        if rules.max_side is None:
            return "resized"
        if m.strategy.max_side is not None and m.strategy.max_side < rules.max_side:
            return f"side < {rules.max_side}"
    if kind == "lossless" and rules.min_psnr is None:
        return None if m.exact else "not exact"
    floor = DEFAULT_MIN_PSNR if rules.min_psnr is None else rules.min_psnr
    return None if m.psnr >= floor else f"PSNR < {floor:g} dB"


def _criteria(kind: str, rules: Rules) -> str:
    fidelity = ("exact (a lossless source)" if kind == "lossless" and rules.min_psnr is None
                else f"PSNR >= {DEFAULT_MIN_PSNR if rules.min_psnr is None else rules.min_psnr:g} dB")
    size = "full resolution" if rules.max_side is None else f"a maximum side of {rules.max_side} or more"
    return f"{fidelity}, {size}"


def recommend(advice: Advice, link: Link, rules: Rules = Rules()) -> Recommendation:
    """The allowed strategy with the shortest predicted epoch; within 1%, the fewer bytes."""
    scored = [(m, predict(m, advice.num_images, link)) for m in advice.rows if _allowed(m, advice.kind, rules) is None]
    best = min(p.epoch_s for _, p in scored)
    m, p = min(((m, p) for m, p in scored if p.epoch_s <= best * TIE), key=lambda mp: (mp[0].mean_bytes, mp[1].epoch_s))
    rate = f"{m.decode_rate:,.0f} img/s " + (f"through {advice.dali}" if m.gpu_rate is not None
                                             else f"on {advice.cores} core(s)")
    why = (f"link-bound: {m.mean_bytes / 1e3:,.1f} KB/img at {_rate(link.bandwidth)}" if p.bound == "link"
           else f"decode-bound: {rate}")
    reason = (f"{m.strategy.name}: the shortest predicted epoch ({_duration(p.epoch_s)}, {why}) of the "
              f"{len(scored)} strategies that keep {_criteria(advice.kind, rules)}")
    original = advice.rows[0]
    if m is not original:
        po = predict(original, advice.num_images, link)
        reason += f"; keeping the original bytes would take {_duration(po.epoch_s)} ({po.bound}-bound)"
    elif len(scored) > 1:
        reason += "; re-encoding would not make an epoch shorter"
    return Recommendation(m, p, tuple(m.strategy.name for m, _ in scored), reason)


# --- showing it ------------------------------------------------------------------------


def _duration(s: float) -> str:
    if s < 10:
        return f"{s:.2f} s"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _rate(bps: float) -> str:
    bits = bps * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


def render(advice: Advice, link: Link, rules: Rules, rec: Recommendation) -> str:
    """The report: what was measured, the table, the bound of each row, the recommendation."""
    from dataferry.schema import format_table

    formats = ", ".join(f"{fmt} {n}" for fmt, n in advice.formats)
    head = [
        f"advise {advice.source}: {advice.num_images:,} images; measured {len(advice.sample)} sampled "
        f"(seed {advice.seed}): {formats}; a {advice.kind} source",
        f"decode: Pillow on {advice.cores} usable core(s); DALI: {advice.dali or 'no GPU'}; "
        f"link {_rate(link.bandwidth)}, RTT {link.rtt * 1e3:g} ms (set-up {SETUP_RTTS} RTT)",
    ]
    if advice.rejected:
        head.append(f"{len(advice.rejected)} sampled image(s) ingest would reject, left out "
                    f"(first: {advice.rejected[0][0]}: {advice.rejected[0][1]})")
    rows = []
    for m in advice.rows:
        p = predict(m, advice.num_images, link)
        why_not = _allowed(m, advice.kind, rules)
        note = "<- recommended" if m is rec.row else (why_not or "")
        rows.append((
            m.strategy.name, f"{m.mean_bytes / 1e3:,.1f}", f"{m.encode_s * 1e3:.1f}", f"{m.cpu_rate:,.0f}",
            f"{m.gpu_rate:,.0f}" if m.gpu_rate is not None else "fails" if m.gpu_error else "no GPU",
            "exact" if m.exact else f"{m.psnr:.1f} dB",
            f"{m.long_in:.0f}" if m.full_resolution else f"{m.long_in:.0f}->{m.long_out:.0f}",
            _duration(p.epoch_s), p.bound, note,
        ))
    table = format_table(("STRATEGY", "KB/IMG", "ENCODE ms", "CPU DECODE img/s", "DALI DECODE img/s", "FIDELITY",
                          "LONG SIDE", "EPOCH", "BOUND", "NOTE"), rows)
    foot = [
        f"EPOCH: {advice.num_images:,} images at max(bytes / link, images / decode rate) + set-up; "
        "BOUND: which of the two is longer. ENCODE: CPU per image at ingest. FIDELITY: PSNR against the "
        "source's pixels (resized ones against the source resized the same way).",
        *(f"DALI fails on {m.strategy.name}'s bytes: {m.gpu_error}" for m in advice.rows if m.gpu_error),
        f"recommended: {rec.reason}",
    ]
    return "\n".join([*head, table, *foot])


def ingest_command(rec: Recommendation, *, src: str | None, dataset: str, store: str) -> str:
    """The ``dataferry ingest`` command that applies ``rec`` (``src`` None: SRC, for a stored dataset)."""
    name = dataset if src is not None else _derived_name(dataset, rec.row.strategy)
    args = ["dataferry", "ingest", src if src is not None else "SRC", "--dataset", name, "--store", store,
            *rec.row.strategy.ingest_args()]
    return shlex.join(args).replace("'SRC'", "SRC")


def _derived_name(dataset: str, s: Strategy) -> str:
    return f"{dataset}-{re.sub(r'[^A-Za-z0-9]+', '-', s.name).strip('-')}"[:128]


def plot(advice: Advice, link: Link, rec: Recommendation, path: str) -> None:
    """A PNG: bytes per image against decode rate, and the predicted epoch per strategy."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = [m.strategy.name for m in advice.rows]
    preds = [predict(m, advice.num_images, link) for m in advice.rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for m in advice.rows:
        mark = "*" if m is rec.row else "o"
        ax1.scatter(m.mean_bytes / 1e3, m.decode_rate, marker=mark, s=160 if m is rec.row else 40)
        ax1.annotate(m.strategy.name, (m.mean_bytes / 1e3, m.decode_rate), fontsize=8, xytext=(4, 4),
                     textcoords="offset points")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("KB per image")
    ax1.set_ylabel(f"decode images/s ({advice.dali or f'Pillow, {advice.cores} cores'})")
    ax1.set_title("bytes against decode rate")
    colors = ["tab:blue" if p.bound == "link" else "tab:orange" for p in preds]
    bars = ax2.barh(names, [p.epoch_s for p in preds], color=colors)
    bars[advice.rows.index(rec.row)].set_edgecolor("black")
    bars[advice.rows.index(rec.row)].set_linewidth(2)
    ax2.invert_yaxis()
    ax2.set_xlabel(f"predicted epoch, s: {advice.num_images:,} images, {_rate(link.bandwidth)}, RTT {link.rtt * 1e3:g} ms")
    ax2.set_title(f"recommended: {rec.row.strategy.name}\nblue: link-bound, orange: decode-bound")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise ConfigError(f"cannot write plot {path!r}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
