"""Validate (and optionally re-encode) one source image: a pure function.

:func:`validate_file` reads a file once, fully decodes it with Pillow (every
frame of a multi-frame image), and returns the bytes to store with what we
know about them, or raises :class:`~dataferry.schema.InvalidImage` with a
short, human reason. It runs in worker processes (:func:`validate_many`), so
its arguments and results are small picklable values, and the image bytes
cross the process boundary once, on the way back.

Pillow's decompression-bomb limit stays on: an image with more pixels than
``max_pixels`` is rejected, whether Pillow would only have warned or raised.
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
import re
import struct
import warnings
import zlib
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from ._errors import ConfigError, InvalidImage

__all__ = [
    "ValidateOptions",
    "ValidatedFile",
    "validate_file",
    "validate_bytes",
    "validate_chunk",
    "validator_pool",
    "DEFAULT_MAX_PIXELS",
    "LOSSLESS",
    "encode_image",
    "prepare_image",
]

#: Pillow's own default limit (about 89.5 Mpx), pinned so it does not depend
#: on whoever changed ``Image.MAX_IMAGE_PIXELS`` in this process.
DEFAULT_MAX_PIXELS = 89_478_485

_FORMATS = {"jpeg": "JPEG", "png": "PNG", "jpeg2000": "JPEG2000"}
#: formats that keep every pixel (``quality`` does not apply)
LOSSLESS = frozenset({"png", "jpeg2000"})
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PIXELS_RE = re.compile(r"\((\d+) pixels\)")


@dataclass(frozen=True, slots=True)
class ValidateOptions:
    """How to store a valid image: ``format=None`` keeps the original bytes."""

    format: str | None = None  # "jpeg" | "png" | "jpeg2000" (lossless; nvJPEG2000 decodes it on GPUs) to re-encode
    quality: int = 90  # JPEG quality when re-encoding
    max_side: int | None = None  # downscale (keeping aspect) so no side exceeds this
    max_pixels: int = DEFAULT_MAX_PIXELS  # decompression-bomb limit, per frame

    def __post_init__(self) -> None:
        if self.format is not None:
            fmt = {"jp2": "jpeg2000", "j2k": "jpeg2000", "jpg": "jpeg"}.get(self.format.lower(), self.format.lower())
            if fmt not in _FORMATS:
                raise ConfigError(f"unknown image format {self.format!r}; use jpeg, png or jpeg2000 "
                                  "(or none to keep bytes)")
            object.__setattr__(self, "format", fmt)
        if not 1 <= self.quality <= 100:
            raise ConfigError(f"quality must be 1..100, got {self.quality}")
        if self.max_side is not None:
            if self.max_side < 1:
                raise ConfigError(f"max_side must be positive, got {self.max_side}")
            if self.format is None:
                raise ConfigError("max_side needs a format to re-encode to (jpeg, png or jpeg2000)")
        if self.max_pixels < 1:
            raise ConfigError(f"max_pixels must be positive, got {self.max_pixels}")


@dataclass(frozen=True, slots=True)
class ValidatedFile:
    """A valid image, ready to store."""

    data: bytes  # the bytes to store
    format: str  # PIL format name of ``data``: JPEG, PNG, GIF, ...
    width: int
    height: int
    sha256: str  # hex digest of ``data``
    bytes_in: int  # size of the source file
    target: bytes | None = None  # the raw target blob, when the source has one

    @property
    def bytes_out(self) -> int:
        return len(self.data)


def validate_file(path: str, options: ValidateOptions = ValidateOptions()) -> ValidatedFile:
    """Read, fully decode and (maybe) re-encode ``path``; InvalidImage if unusable."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise InvalidImage(path, "file not found") from None
    except PermissionError:
        raise InvalidImage(path, "permission denied") from None
    except IsADirectoryError:
        raise InvalidImage(path, "is a directory") from None
    except OSError as exc:
        raise InvalidImage(path, f"cannot read ({exc.strerror or exc})") from exc
    return validate_bytes(path, data, options)


def validate_bytes(path: str, data: bytes, options: ValidateOptions = ValidateOptions()) -> ValidatedFile:
    """:func:`validate_file` for bytes already read; ``path`` names them in errors."""
    if not data:
        raise InvalidImage(path, "empty file")
    if data.startswith(_PNG_SIGNATURE):
        _check_png_chunks(path, data)
    try:
        with _bomb_limit(options.max_pixels):
            with Image.open(io.BytesIO(data)) as im:
                fmt = im.format or "unknown"
                _check_pixels(im.size, options.max_pixels)
                _decode_all_frames(im)
                if options.format is None:
                    out, width, height = data, im.width, im.height
                else:
                    im.seek(0)
                    out, fmt, width, height = _reencode(im, options)
    except InvalidImage as exc:
        raise InvalidImage(path, exc.reason) from None
    except UnidentifiedImageError:
        raise InvalidImage(path, "not an image (cannot identify)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidImage(path, _bomb_reason(str(exc), options.max_pixels)) from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, MemoryError) as exc:
        raise InvalidImage(path, _decode_reason(exc)) from None
    if width < 1 or height < 1:
        raise InvalidImage(path, f"zero-size image ({width}x{height})")
    return ValidatedFile(out, fmt, width, height, hashlib.sha256(out).hexdigest(), len(data))


@contextmanager
def _bomb_limit(max_pixels: int):
    """Pillow's bomb check at ``max_pixels``, its warning raised as an error.

    Sets a Pillow module global for the duration: fine in the worker
    processes this runs in, not safe to share with other threads using Pillow.
    """
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def _check_pixels(size: tuple[int, int], max_pixels: int) -> None:
    if size[0] * size[1] > max_pixels:
        raise InvalidImage("", f"decompression bomb: {size[0] * size[1]} pixels > limit {max_pixels}")


def _bomb_reason(message: str, max_pixels: int) -> str:
    m = _PIXELS_RE.search(message)
    return f"decompression bomb: {m.group(1) if m else '?'} pixels > limit {max_pixels}"


def _decode_reason(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, MemoryError):
        return "out of memory while decoding"
    if "truncated" in text or isinstance(exc, EOFError):
        return "truncated image"
    text = text.split(" (", 1)[0] if len(text) > 80 else text
    return f"cannot decode ({text or type(exc).__name__})"


def _decode_all_frames(im: Image.Image) -> None:
    """Decode every frame; Pillow checks each frame against the bomb limit."""
    frames = getattr(im, "n_frames", 1)
    for i in range(frames):
        if i:
            im.seek(i)
        im.load()


def _check_png_chunks(path: str, data: bytes) -> None:
    """Verify every PNG chunk's CRC; Pillow skips the IDAT ones."""
    pos, end = len(_PNG_SIGNATURE), len(data)
    while pos + 12 <= end:
        length, ctype = struct.unpack_from(">I4s", data, pos)
        stop = pos + 8 + length
        if stop + 4 > end:
            raise InvalidImage(path, "truncated image")
        (crc,) = struct.unpack_from(">I", data, stop)
        if zlib.crc32(data[pos + 4 : stop]) != crc:
            raise InvalidImage(path, f"corrupt PNG (CRC error in {ctype.decode('latin-1')} chunk)")
        if ctype == b"IEND":
            return
        pos = stop + 4
    raise InvalidImage(path, "truncated image")


def _to_storable(im: Image.Image, fmt: str) -> Image.Image:
    """Convert modes the target format cannot hold: CMYK, 16-bit, palette, alpha."""
    mode = im.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        if fmt in ("PNG", "JPEG2000") and mode.startswith("I;16"):
            return im
        # scale a 16-bit (or wider) range down to 8 bits instead of clipping it
        hi = 65535 if mode.startswith("I;16") or (im.getextrema()[1] or 0) > 255 else 255
        return im.convert("I").point(lambda v: v * (255 / hi)).convert("L")
    if mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
    elif mode == "PA":
        im = im.convert("RGBA")
    elif mode == "1":
        im = im.convert("L")
    elif mode not in ("L", "LA", "RGB", "RGBA"):
        im = im.convert("RGB")  # CMYK, YCbCr, LAB, HSV
    if fmt == "JPEG" and im.mode in ("RGBA", "LA"):
        base = Image.new("RGB" if im.mode == "RGBA" else "L", im.size, (255, 255, 255) if im.mode == "RGBA" else 255)
        base.paste(im, mask=im.getchannel("A"))
        im = base
    return im


def prepare_image(im: Image.Image, format: str, max_side: int | None = None) -> Image.Image:
    """The pixels ingest encodes when it re-encodes ``im`` as ``format``: EXIF
    orientation applied, converted to a mode ``format`` holds, downscaled
    (Lanczos, keeping aspect) so no side exceeds ``max_side``."""
    fmt = _FORMATS[format]
    out = _to_storable(ImageOps.exif_transpose(im), fmt)
    if max_side is not None and max(out.size) > max_side:
        scale = max_side / max(out.size)
        size = (max(1, round(out.width * scale)), max(1, round(out.height * scale)))
        out = out.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
    return out


def _reencode(im: Image.Image, options: ValidateOptions) -> tuple[bytes, str, int, int]:
    format = options.format or "jpeg"
    mode_in = im.mode
    out = prepare_image(im, format, options.max_side)
    icc = im.info.get("icc_profile") if out.mode == mode_in else None  # a CMYK profile would lie about converted RGB
    return encode_image(out, format, options.quality, icc_profile=icc), _FORMATS[format], out.width, out.height


def _save_params(fmt: str, mode: str, quality: int) -> dict:
    """Pillow's save options for ``fmt``. JPEG 2000 is written reversible
    (the 5/3 wavelet and, for colour, the reversible colour transform, one
    quality layer): lossless, in a JP2 container; Pillow and DALI's CPU decoder
    read it with OpenJPEG (tested), and DALI documents decoding it on the GPU
    with nvJPEG2000 (not yet run on a GPU here)."""
    if fmt == "JPEG":
        return {"quality": quality}
    if fmt == "JPEG2000":
        return {"irreversible": False, "mct": 1 if mode in ("RGB", "RGBA") else 0, "no_jp2": False}
    return {"compress_level": 6}


def encode_image(im: Image.Image, format: str, quality: int = 90, *, icc_profile: bytes | None = None) -> bytes:
    """``im`` (already in a mode ``format`` holds) encoded as ``format`` (``jpeg``, ``png`` or ``jpeg2000``)."""
    fmt = _FORMATS[format]
    params = _save_params(fmt, im.mode, quality)
    if icc_profile:
        params["icc_profile"] = icc_profile
    buf = io.BytesIO()
    im.save(buf, fmt, **params)
    return buf.getvalue()


# --- running it in worker processes ------------------------------------------


def validate_chunk(
    jobs: Sequence[tuple[str, str | None]], options: ValidateOptions
) -> list[ValidatedFile | InvalidImage]:
    """Validate ``(image_path, target_path_or_None)`` jobs; never raises per file.

    The unit of work sent to a worker process: a chunk amortizes the IPC.
    """
    out: list[ValidatedFile | InvalidImage] = []
    for path, target in jobs:
        try:
            vf = validate_file(path, options)
            if target is not None:
                vf = _with_target(path, target, vf)
            out.append(vf)
        except InvalidImage as exc:
            out.append(exc)
        except Exception as exc:  # a Pillow plugin choking on hostile input
            out.append(InvalidImage(path, f"cannot decode ({type(exc).__name__}: {exc})"))
    return out


def _with_target(path: str, target: str, vf: ValidatedFile) -> ValidatedFile:
    try:
        with open(target, "rb") as fh:
            blob = fh.read()
    except FileNotFoundError:
        raise InvalidImage(path, f"target file not found: {target}") from None
    except OSError as exc:
        raise InvalidImage(path, f"cannot read target {target} ({exc.strerror or exc})") from exc
    return ValidatedFile(vf.data, vf.format, vf.width, vf.height, vf.sha256, vf.bytes_in, blob)


def validator_pool(workers: int | None = None) -> ProcessPoolExecutor:
    """A process pool for :func:`validate_chunk`: ``os.cpu_count()`` workers by default.

    Workers start with ``forkserver`` (``spawn`` where there is none), never a
    bare ``fork`` of a process that already runs event-loop and store threads.
    """
    n = workers if workers is not None else (os.cpu_count() or 1)
    if n < 1:
        raise ConfigError(f"workers must be at least 1, got {n}")
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    return ProcessPoolExecutor(max_workers=n, mp_context=ctx)
