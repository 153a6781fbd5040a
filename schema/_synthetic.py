"""A synthetic ImageNet-like dataset: an ImageFolder tree of realistic JPEGs.

Each image is a smooth colour field (a gradient plus low-frequency blobs), a
few solid shapes, and uniform noise, so JPEG cannot squeeze it to nothing.
Sizes are ImageNet-like: the long side 400-640 px, common aspect ratios,
landscape three times out of four. The noise amplitude is calibrated once per
JPEG quality (deterministically, on a fixed calibration set) so the mean file
is about ``target_kb`` (110 KB by default). Everything derives from ``seed``
and the image index, so a tree is byte-identical on every run with the same
Pillow, and images can be rendered in any order, in parallel threads.
"""

from __future__ import annotations

import functools
import io
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from ._errors import ConfigError

__all__ = ["SyntheticSet", "make_synthetic", "class_names"]

_ASPECTS = (1.0, 5 / 4, 4 / 3, 4 / 3, 3 / 2, 3 / 2, 16 / 9)
_CALIBRATION_SEED = 0x5EED


@dataclass(frozen=True, slots=True)
class SyntheticSet:
    root: str
    num_images: int
    label_names: tuple[str, ...]
    total_bytes: int

    @property
    def mean_bytes(self) -> float:
        return self.total_bytes / self.num_images if self.num_images else 0.0


def class_names(classes: int) -> tuple[str, ...]:
    """``class_000``, ``class_001``, ...: zero-padded so name order is number order."""
    width = max(3, len(str(classes - 1)))
    return tuple(f"class_{k:0{width}d}" for k in range(classes))


def _size(rng: np.random.Generator) -> tuple[int, int]:
    long = int(rng.integers(400, 641))
    short = max(240, round(long / _ASPECTS[int(rng.integers(len(_ASPECTS)))]))
    return (long, short) if rng.random() < 0.75 else (short, long)


def _render(seed: int, index: int, label: int, amp: float, quality: int, size: tuple[int, int] | None = None) -> bytes:
    """One JPEG. ``amp`` scales the noise (calibrated); ``size`` overrides the drawn size."""
    rng = np.random.default_rng([seed, index])
    w, h = _size(rng)
    if size is not None:
        w, h = size
    # a smooth field at 1/16 scale, upsampled: a gradient from a class colour
    lw, lh = w // 16 + 2, h // 16 + 2
    hue = np.array([(label * 0.618034) % 1.0, 0.6, 0.8])
    c0 = (_hsv_to_rgb(hue) * 255 + rng.uniform(-30, 30, 3)).astype(np.float32)
    c1 = rng.uniform(0, 255, 3).astype(np.float32)
    t = rng.uniform(0, 2 * np.pi)
    g = np.cos(t) * np.linspace(0, 1, lw, dtype=np.float32)[None, :] + np.sin(t) * np.linspace(
        0, 1, lh, dtype=np.float32
    )[:, None]
    g = (g - g.min()) / (np.ptp(g) + 1e-6)
    low = c0 + (c1 - c0) * g[..., None] + rng.uniform(-50, 50, (lh, lw, 3)).astype(np.float32)
    im = Image.fromarray(np.clip(low, 0, 255).astype(np.uint8)).resize((w, h), Image.Resampling.BILINEAR)
    draw = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        box = [x0, y0, x0 + int(rng.integers(20, w // 2)), y0 + int(rng.integers(20, h // 2))]
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    # noise, its strength varying +-25% per image around the calibrated amplitude
    a = max(0, round(amp * rng.uniform(0.75, 1.25)))
    arr = np.asarray(im, dtype=np.int16)
    if a:
        arr += rng.integers(-a, a + 1, arr.shape, dtype=np.int16)
        np.clip(arr, 0, 255, out=arr)
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8)).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _hsv_to_rgb(hsv: np.ndarray) -> np.ndarray:
    h, s, v = hsv
    i, f = int(h * 6) % 6, h * 6 - int(h * 6)
    p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
    return np.array([(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i])


@functools.lru_cache(maxsize=32)
def _calibrate(quality: int, target_bytes: int) -> float:
    """The noise amplitude whose mean file size is ``target_bytes``.

    Bytes scale with pixels, so this measures bytes per pixel on 8 mid-size
    calibration images and aims at ``target_bytes / E[pixels]``, with
    ``E[pixels]`` taken over 4,096 draws of the size distribution.
    """
    rng = np.random.default_rng(_CALIBRATION_SEED)
    mean_px = float(np.mean([w * h for w, h in (_size(rng) for _ in range(4096))]))
    target_bpp = target_bytes / mean_px
    side = (520, 390)

    def bpp(amp: float) -> float:
        sizes = [len(_render(_CALIBRATION_SEED, i, i, amp, quality, side)) for i in range(8)]
        return float(np.mean(sizes)) / (side[0] * side[1])

    lo, hi = 0.0, 128.0
    if bpp(hi) < target_bpp:
        return hi  # this quality cannot reach the target: the largest we make
    for _ in range(7):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if bpp(mid) < target_bpp else (lo, mid)
    return (lo + hi) / 2


def make_synthetic(
    root: str | os.PathLike[str],
    num_images: int,
    *,
    classes: int = 10,
    seed: int = 0,
    quality: int = 90,
    target_kb: float = 110.0,
    workers: int | None = None,
) -> SyntheticSet:
    """Write ``num_images`` JPEGs under ``root/<class>/<index>.jpg`` (see module docs).

    Image ``i`` has label ``i % classes``. Existing files of the same names
    are overwritten (with the same bytes, for the same arguments).
    """
    if num_images < 0:
        raise ConfigError(f"number of synthetic images must be >= 0, got {num_images}")
    if classes < 1:
        raise ConfigError(f"synthetic classes must be >= 1, got {classes}")
    if not 1 <= quality <= 100:
        raise ConfigError(f"quality must be 1..100, got {quality}")
    if target_kb <= 0:
        raise ConfigError(f"target_kb must be positive, got {target_kb}")
    root = os.path.abspath(os.fspath(root))
    names = class_names(classes)
    for name in names:
        os.makedirs(os.path.join(root, name), exist_ok=True)
    amp = _calibrate(quality, round(target_kb * 1000))
    width = max(6, len(str(num_images - 1)))

    def one(i: int) -> int:
        data = _render(seed, i, i % classes, amp, quality)
        with open(os.path.join(root, names[i % classes], f"{i:0{width}d}.jpg"), "wb") as fh:
            fh.write(data)
        return len(data)

    # numpy's generators and Pillow's encoder release the GIL: threads suffice
    n_threads = max(1, min(workers or os.cpu_count() or 1, 32))
    with ThreadPoolExecutor(n_threads, thread_name_prefix="dataferry-synth") as pool:
        total = sum(pool.map(one, range(num_images), chunksize=16))
    return SyntheticSet(root, num_images, names, total)
