"""Image transforms shared by the DALI and the PyTorch paths, and the target encodings.

A transform is a frozen option object (:class:`TrainTransform`, :class:`EvalTransform`, or
None: decode only); the work is plain functions, the same three steps on both paths, so
they agree to within resampling error: :func:`crop_windows` draws a crop window and a flip
bit per sample from the images' header sizes, keyed by ``(seed, epoch, sample id)``; the
window is decoded and resized to ``size x size``; then flipped and normalized to float32
NCHW. Targets (``TargetKind``): ``"none"``, ``"mask"`` (a single-channel 8-bit PNG or
lossless JP2 of class indices, cropped with its image) or ``"multilabel"`` (a float32
vector). The windows, the encodings and what is refused: client/README.md ("Transforms
and targets").
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from dataferry.schema import InvalidImage, check as _check

__all__ = [
    "TargetKind",
    "TrainTransform",
    "EvalTransform",
    "Transform",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "crop_windows",
    "image_size",
    "check_mask",
    "decode_multilabel",
    "decode_rgb",
    "decode_mask",
    "transform_image",
    "transform_mask",
]

TargetKind = Literal["none", "mask", "multilabel"]
TARGET_KINDS: tuple[str, ...] = get_args(TargetKind)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_TRIES = 10  # torchvision's RandomResizedCrop attempts


def _check_norm(mean: Sequence[float], std: Sequence[float]) -> None:
    _check(len(mean) == 3 and len(std) == 3, "mean and std need 3 values (R, G, B)")
    _check(all(s > 0 for s in std), f"std must be > 0, got {tuple(std)}")


@dataclass(frozen=True, slots=True)
class TrainTransform:
    """Random resized crop to ``size x size``, horizontal flip with
    probability ``flip``, normalize. ``scale`` bounds the crop's share of the
    image area, ``ratio`` its aspect (width / height)."""

    size: int = 224
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __post_init__(self) -> None:
        _check(self.size >= 1, f"size must be >= 1, not {self.size}")
        _check(0 < self.scale[0] <= self.scale[1] <= 1, f"need 0 < scale[0] <= scale[1] <= 1, got {self.scale}")
        _check(0 < self.ratio[0] <= self.ratio[1], f"need 0 < ratio[0] <= ratio[1], got {self.ratio}")
        _check(0 <= self.flip <= 1, f"flip is a probability, not {self.flip}")
        _check_norm(self.mean, self.std)


@dataclass(frozen=True, slots=True)
class EvalTransform:
    """Resize the short side to ``resize``, centre-crop ``size x size``, normalize."""

    size: int = 224
    resize: int = 256
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __post_init__(self) -> None:
        _check(self.size >= 1, f"size must be >= 1, not {self.size}")
        _check(self.resize >= self.size, f"resize ({self.resize}) must be >= size ({self.size})")
        _check_norm(self.mean, self.std)


Transform = TrainTransform | EvalTransform | None


def check_targets(targets: str) -> None:
    _check(targets in TARGET_KINDS, f"targets must be one of {TARGET_KINDS}, not {targets!r}")


# --- randomness: a counter-based hash, so a sample's draw depends on nothing else --------
_M64 = (1 << 64) - 1


def _uniforms(seed: int, epoch: int, ids: np.ndarray, k: int) -> np.ndarray:
    """``[len(ids), k]`` floats in [0, 1): splitmix64 of (seed, epoch, id, column)."""
    key = ((seed & _M64) * 0x9E3779B97F4A7C15 ^ ((epoch & _M64) * 0xD1B54A32D192ED03 + 0x8CB92BA72F3D8DD7)) & _M64
    with np.errstate(over="ignore"):
        x = np.ascontiguousarray(ids, np.int64).view(np.uint64)[:, None] * np.uint64(0xBF58476D1CE4E5B9)
        x = x + np.uint64(key) + np.arange(k, dtype=np.uint64)[None, :] * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def crop_windows(
    transform: TrainTransform | EvalTransform, hw: np.ndarray, ids: np.ndarray, *, seed: int, epoch: int
) -> tuple[np.ndarray, np.ndarray]:
    """Crop windows ``int32 [N, 4]`` as ``(x, y, w, h)`` and flips ``bool [N]``
    for images of sizes ``hw`` (``[N, 2]``: height, width)."""
    hw = np.asarray(hw, np.int64).reshape(-1, 2)
    n = hw.shape[0]
    H, W = hw[:, 0].astype(np.float64), hw[:, 1].astype(np.float64)
    if isinstance(transform, EvalTransform):
        short = np.minimum(H, W)
        side = np.clip(np.round(transform.size * short / transform.resize), 1, short)
        x, y = np.round((W - side) / 2), np.round((H - side) / 2)
        win = np.stack([x, y, side, side], axis=1).astype(np.int32)
        return win, np.zeros(n, bool)
    u = _uniforms(seed, epoch, ids, 4 * _TRIES + 1)
    s0, s1 = transform.scale
    r0, r1 = math.log(transform.ratio[0]), math.log(transform.ratio[1])
    area = (H * W)[:, None] * (s0 + (s1 - s0) * u[:, :_TRIES])
    aspect = np.exp(r0 + (r1 - r0) * u[:, _TRIES : 2 * _TRIES])
    w = np.round(np.sqrt(area * aspect))
    h = np.round(np.sqrt(area / aspect))
    ok = (w > 0) & (h > 0) & (w <= W[:, None]) & (h <= H[:, None])
    pick = ok.argmax(axis=1)
    rows = np.arange(n)
    w, h = w[rows, pick], h[rows, pick]
    y = np.floor(u[rows, 2 * _TRIES + pick] * (H - h + 1))
    x = np.floor(u[rows, 3 * _TRIES + pick] * (W - w + 1))
    # no try fit: the whole image, cut to the nearest allowed aspect, centred
    bad = ~ok.any(axis=1)
    if bad.any():
        Hb, Wb = H[bad], W[bad]
        ar = Wb / Hb
        lo, hi = transform.ratio
        wb = np.where(ar > hi, np.round(Hb * hi), Wb)
        hb = np.where(ar < lo, np.round(Wb / lo), Hb)
        w[bad], h[bad] = wb, hb
        y[bad], x[bad] = np.floor((Hb - hb) / 2), np.floor((Wb - wb) / 2)
    win = np.stack([x, y, w, h], axis=1).astype(np.int32)
    return win, u[:, -1] < transform.flip


# --- headers -----------------------------------------------------------------------------
_PNG = b"\x89PNG\r\n\x1a\n"
_JP2 = b"\x00\x00\x00\x0cjP  \r\n\x87\n"  # the JPEG 2000 signature box
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg_size(b: memoryview) -> tuple[int, int] | None:
    i, n = 2, len(b)
    while i + 9 <= n:
        if b[i] != 0xFF:
            return None
        m = b[i + 1]
        if m == 0xFF:  # fill byte
            i += 1
        elif m in _SOF:
            return (b[i + 5] << 8 | b[i + 6], b[i + 7] << 8 | b[i + 8])
        elif m == 0x01 or 0xD0 <= m <= 0xD8:  # markers without a length
            i += 2
        else:
            i += 2 + (b[i + 2] << 8 | b[i + 3])
    return None


def _jp2_header(b: memoryview) -> tuple[int, int, int, int] | None:
    """``(height, width, components, bits)`` from a JP2 file's image header box (it leads the header superbox)."""
    head = bytes(b[:256])
    i = head.find(b"ihdr")
    if i < 0 or i + 15 > len(head):
        return None
    return (int.from_bytes(head[i + 4:i + 8], "big"), int.from_bytes(head[i + 8:i + 12], "big"),
            int.from_bytes(head[i + 12:i + 14], "big"), (head[i + 14] & 0x7F) + 1)


def image_size(data, what: str = "image") -> tuple[int, int]:
    """``(height, width)`` from the header of an encoded image (JPEG, PNG and
    JP2 parsed here in microseconds, anything else by Pillow)."""
    b = memoryview(data).cast("B")
    size = None
    if b[:2] == b"\xff\xd8":
        size = _jpeg_size(b)
    elif b[:8] == _PNG and b[12:16] == b"IHDR":
        size = (int.from_bytes(b[20:24], "big"), int.from_bytes(b[16:20], "big"))
    elif b[:12] == _JP2 and (jp2 := _jp2_header(b)) is not None:
        size = jp2[:2]
    if size is None:
        from PIL import Image

        try:
            with Image.open(io.BytesIO(b)) as im:
                w, h = im.size
        except Exception as exc:  # noqa: BLE001 - Pillow raises many types
            raise InvalidImage(what, f"cannot read the image header: {exc}") from exc
        size = (h, w)
    if size[0] < 1 or size[1] < 1:
        raise InvalidImage(what, f"image header says {size[1]}x{size[0]}")
    return size


def check_mask(data, hw: tuple[int, int], what: str) -> None:
    """A mask must be an 8-bit single-channel PNG or lossless JPEG 2000 (JP2) of its image's size."""
    b = memoryview(data).cast("B")
    if b[:12] == _JP2:
        jp2 = _jp2_header(b)
        if jp2 is None:
            raise InvalidImage(what, "mask is a JP2 file without an image header")
        mh, mw, components, bits = jp2
        if components != 1 or bits != 8:
            raise InvalidImage(what, f"mask must be 8-bit single-channel, not a JP2 of {components} "
                                     f"component(s) of {bits} bits")
    else:
        if b[:8] != _PNG or b[12:16] != b"IHDR" or len(b) < 26:
            raise InvalidImage(what, "mask is not a PNG or JP2")
        depth, colour = b[24], b[25]
        if depth != 8 or colour != 0:
            raise InvalidImage(what, f"mask must be an 8-bit single-channel PNG (colour type 0), "
                                     f"not bit depth {depth} colour type {colour}")
        mh, mw = int.from_bytes(b[20:24], "big"), int.from_bytes(b[16:20], "big")
    if (mh, mw) != tuple(hw):
        raise InvalidImage(what, f"mask is {mw}x{mh}, its image {hw[1]}x{hw[0]}")


# --- target decodings (the encodings are ingest's: dataferry.schema.encode_mask/encode_multilabel) ---
def decode_multilabel(blobs: Sequence[bytes | None], ids: Sequence[int], dataset: str) -> np.ndarray:
    """``float32 [N, num_classes]`` from the blobs of one batch."""
    lengths = set()
    for blob, sid in zip(blobs, ids):
        if blob is None:
            raise InvalidImage(f"dataset {dataset!r} sample {sid}", "no multilabel target")
        lengths.add(len(blob))
    if len(lengths) > 1 or (lengths and next(iter(lengths)) % 4):
        raise InvalidImage(f"dataset {dataset!r} samples {list(ids)[:8]}", "multilabel targets must be float32 "
                           f"vectors of one length, got byte lengths {sorted(lengths)}")
    return np.frombuffer(b"".join(blobs), "<f4").reshape(len(blobs), -1).astype(np.float32)


# --- the CPU implementation (Pillow + numpy): decode, crop-resize, flip, normalize ----------
def _decode(data, what: str, failed: str):
    """A Pillow image from encoded bytes, fully decoded; InvalidImage ``"{failed}: {Pillow's reason}"``."""
    from PIL import Image

    try:
        im = Image.open(io.BytesIO(data))
        im.load()
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types
        raise InvalidImage(what, f"{failed}: {exc}") from exc
    return im


def decode_rgb(data, what: str = "image"):
    """A Pillow RGB image from encoded bytes, fully decoded."""
    im = _decode(data, what, "cannot decode")
    return im if im.mode == "RGB" else im.convert("RGB")


def decode_mask(data, what: str = "mask"):
    im = _decode(data, what, "cannot decode the mask")
    if im.mode != "L":
        raise InvalidImage(what, f"mask must be single-channel 8-bit, not mode {im.mode}")
    return im


def transform_image(im, window, flip: bool, transform: TrainTransform | EvalTransform, out: np.ndarray) -> None:
    """Crop ``window`` of the Pillow image, resize, flip, normalize into ``out`` (float32 [3, S, S])."""
    from PIL import Image

    x, y, w, h = (int(v) for v in window)
    s = transform.size
    im = im.resize((s, s), Image.Resampling.BILINEAR, box=(x, y, x + w, y + h))
    arr = np.asarray(im)
    if flip:
        arr = arr[:, ::-1]
    scale = np.float32(1 / 255) / np.asarray(transform.std, np.float32)
    shift = np.asarray(transform.mean, np.float32) / np.asarray(transform.std, np.float32)
    np.subtract(arr * scale, shift, out=out.transpose(1, 2, 0), casting="same_kind")


def transform_mask(im, window, flip: bool, size: int) -> np.ndarray:
    """The mask under the same window and flip: ``uint8 [S, S]`` (nearest)."""
    from PIL import Image

    x, y, w, h = (int(v) for v in window)
    arr = np.asarray(im.resize((size, size), Image.Resampling.NEAREST, box=(x, y, x + w, y + h)))
    return arr[:, ::-1] if flip else arr
