"""What the advisor measures and decides, as values: ``dataferry advise``'s types.

:class:`Strategy` is one way to store the images (:func:`candidates`: those
worth measuring for a kind of source); :class:`AdviseOptions` says what to
measure, :class:`Link` and :class:`Rules` what to predict over and allow.
:class:`Measurement` and :class:`Advice` are what ``_measure.py`` found,
:class:`Prediction` and :class:`Recommendation` what ``_recommend.py`` makes
of it. :class:`DecodeProbe` is the advisor's seam to the machine that will
train: the client implements it, a floor above.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .._errors import ConfigError
from .._validate import DEFAULT_MAX_PIXELS, LOSSLESS, ValidateOptions

__all__ = [
    "DEFAULT_MIN_PSNR", "SETUP_RTTS", "TIE", "DecodeProbe", "Probe", "Strategy", "candidates", "AdviseOptions", "Link",
    "Rules", "Measurement", "Advice", "Prediction", "Recommendation",
]

#: the fidelity a lossy source's strategies must keep unless ``Rules.min_psnr`` says otherwise
DEFAULT_MIN_PSNR = 38.0
#: connection, TLS, the split's id list and the first batch
SETUP_RTTS = 4
#: predicted epochs within this ratio of the shortest count as a tie (fewer bytes wins)
TIE = 1.01


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
    """One strategy measured on the sample (see :func:`~._measure.measure`)."""

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
