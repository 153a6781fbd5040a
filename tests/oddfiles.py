"""Build an ImageFolder tree full of odd but valid images, bad files and junk.

Used by the ingest and CLI tests: :func:`build_odd_tree` writes the tree and
returns what a correct ingest must make of it.
"""

from __future__ import annotations

import io
import os
import struct
import unicodedata
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["OddTree", "build_odd_tree", "png_bomb", "noise_image"]


@dataclass
class OddTree:
    root: Path
    #: relpath (NFC, '/'-separated) -> class name, for every valid image
    valid: dict[str, str] = field(default_factory=dict)
    #: relpath -> a fragment the reject reason must contain
    bad: dict[str, str] = field(default_factory=dict)
    #: relpaths that must be skipped as non-images
    junk: list[str] = field(default_factory=list)
    #: relpath -> the name on disk (which may be NFD)
    disk: dict[str, Path] = field(default_factory=dict)

    def path(self, rel: str) -> Path:
        return self.disk[rel]

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(sorted({rel.split("/", 1)[0] for rel in [*self.valid, *self.bad]}))


def noise_image(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = len(Image.new(mode, (1, 1)).getbands())
    arr = rng.integers(0, 256, size=(h, w, bands), dtype=np.uint8)
    return Image.fromarray(arr.squeeze(-1) if bands == 1 else arr, "L" if bands == 1 else ("RGBA" if bands == 4 else "RGB"))


def _chunk(ctype: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + ctype + payload + struct.pack(">I", zlib.crc32(ctype + payload))


def png_bomb(side: int = 20_000) -> bytes:
    """A real, valid 1-bit ``side`` x ``side`` PNG of zeros: a few dozen KB."""
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte + packed bits
    z = zlib.compressobj(9)
    body = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


def _save(im: Image.Image, fmt: str, **params) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **params)
    return buf.getvalue()


def build_odd_tree(root: str | os.PathLike[str]) -> OddTree:
    root = Path(root)
    tree = OddTree(root)

    def put(rel: str, data: bytes, kind: str, what: str = "") -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        key = unicodedata.normalize("NFC", rel)
        tree.disk[key] = path
        if kind == "valid":
            tree.valid[key] = key.split("/", 1)[0]
        elif kind == "bad":
            tree.bad[key] = what
        else:
            tree.junk.append(key)

    rgb = noise_image(64, 48, seed=1)
    put("cat/rgb.jpg", _save(rgb, "JPEG", quality=90), "valid")
    put("cat/cmyk.jpg", _save(rgb.convert("CMYK"), "JPEG"), "valid")
    gray16 = Image.fromarray(np.arange(40 * 30, dtype=np.uint16).reshape(30, 40) * 50)
    put("cat/gray16.png", _save(gray16, "PNG"), "valid")
    frames = [noise_image(32, 32, seed=s).convert("P") for s in range(3)]
    put("cat/anim.gif", _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0), "valid")
    pages = [noise_image(40, 40, seed=s) for s in range(3)]
    put("dog/multipage.tif", _save(pages[0], "TIFF", save_all=True, append_images=pages[1:]), "valid")
    put("dog/photo.webp", _save(noise_image(50, 40, seed=2), "WEBP", quality=80), "valid")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 CW to display
    put("dog/exif rotated.jpg", _save(noise_image(60, 30, seed=3), "JPEG", exif=exif), "valid")
    put("dog/ünïcödé name.jpg", _save(noise_image(30, 30, seed=4), "JPEG"), "valid")
    put(unicodedata.normalize("NFD", "dog/café nfd.png"), _save(noise_image(20, 20, seed=5), "PNG"), "valid")
    put("dog/UPPER.JPG", _save(noise_image(33, 22, seed=6), "JPEG"), "valid")
    put("dog/deep/er/nested.png", _save(noise_image(16, 16, seed=7), "PNG"), "valid")
    pal = noise_image(24, 24, seed=8).convert("P")
    put("bird/palette.png", _save(pal, "PNG", transparency=0), "valid")
    put("bird/alpha.png", _save(noise_image(24, 24, "RGBA", seed=9), "PNG"), "valid")
    put("bird/plain.bmp", _save(rgb, "BMP"), "valid")
    put("bird/plain.ppm", _save(rgb, "PPM"), "valid")
    put("bird/gray.pgm", _save(rgb.convert("L"), "PPM"), "valid")

    jpeg = _save(noise_image(200, 200, seed=10), "JPEG", quality=95)
    put("cat/truncated.jpg", jpeg[: len(jpeg) // 2], "bad", "truncated image")
    put("cat/empty.jpg", b"", "bad", "empty file")
    put("dog/notes.png", b"this is not a PNG, it is a text file\n", "bad", "not an image (cannot identify)")
    png = bytearray(_save(noise_image(30, 30, seed=11), "PNG"))
    idat = png.index(b"IDAT")
    (length,) = struct.unpack(">I", png[idat - 4 : idat])
    png[idat + 4 + length] ^= 0xFF  # flip a byte of the IDAT chunk's CRC
    put("dog/badcrc.png", bytes(png), "bad", "corrupt PNG (CRC error")
    put("bird/bomb.png", png_bomb(), "bad", "decompression bomb: 400000000 pixels > limit")

    put("README.txt", b"the odd tree\n", "junk")
    put("cat/.DS_Store", b"\x00\x00\x00\x01Bud1", "junk")
    put("cat/._rgb.jpg", b"\x00\x05\x16\x07", "junk")
    put("dog/Thumbs.db", b"\xd0\xcf\x11\xe0", "junk")
    put("bird/desktop.ini", b"[.ShellClassInfo]\n", "junk")
    put("bird/labels.txt", b"bird\n", "junk")
    return tree
