"""Target encodings: how a sample's ``target`` blob stores a mask or a
multilabel vector. Written at ingest (or by your own writer), decoded by the
client's iterators (``targets="mask"`` / ``"multilabel"``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._errors import ConfigError

__all__ = ["encode_mask", "encode_multilabel"]


def encode_mask(mask: np.ndarray, format: str = "png") -> bytes:
    """A ``uint8 [H, W]`` class-index mask as the blob ``"mask"`` targets expect:
    PNG, or lossless JPEG 2000 (``format="jpeg2000"``; pixel-exact, like the PNG)."""
    from PIL import Image

    from ._validate import encode_image

    arr = np.asarray(mask)
    if arr.ndim != 2 or arr.dtype != np.uint8:
        raise ConfigError(f"a mask is uint8 [H, W], not {arr.dtype} {list(arr.shape)}")
    if format not in ("png", "jpeg2000"):
        raise ConfigError(f"a mask is stored as png or jpeg2000 (both lossless), not {format!r}")
    return encode_image(Image.fromarray(arr, "L"), format)


def encode_multilabel(vector: Sequence[float] | np.ndarray) -> bytes:
    """A ``num_classes`` vector (0/1 or soft) as the blob ``"multilabel"`` targets expect."""
    arr = np.asarray(vector, dtype="<f4")
    if arr.ndim != 1:
        raise ConfigError(f"a multilabel target is a 1-d vector, not shape {list(arr.shape)}")
    return arr.tobytes()
