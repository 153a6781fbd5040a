"""Lossless images decoded on the GPU: ``ingest --format jpeg2000`` (reversible JPEG 2000 in JP2).

Pixel-exact through ``dataferry ingest``, the store, the Loader and both
iterators (Pillow on the PyTorch path; DALI, here on the CPU: OpenJPEG; on a
GPU machine nvJPEG2000 through ``mixed``), masks included.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from PIL import Image  # noqa: E402
from test_torch_path import check_coordinates, coord_image, coord_samples, png, run_epochs  # noqa: E402

from dataferry.client import Loader, MemorySource  # noqa: E402
from dataferry.client._torch import TorchIterator  # noqa: E402
from dataferry.client._transforms import TrainTransform, check_mask, image_size  # noqa: E402
from dataferry.schema import encode_mask  # noqa: E402
from dataferry.schema._errors import ConfigError, InvalidImage  # noqa: E402
from dataferry.schema._validate import ValidateOptions, validate_bytes  # noqa: E402


def photo(rng: np.random.Generator, h: int, w: int, mode: str = "RGB") -> np.ndarray:
    """A smooth image with noise on top: every pixel value matters to an exact comparison."""
    low = rng.integers(0, 256, (h // 16 + 2, w // 16 + 2, 3), dtype=np.uint8)
    arr = np.asarray(Image.fromarray(low).resize((w, h), Image.Resampling.BICUBIC), np.int16)
    arr = np.clip(arr + rng.integers(-6, 7, arr.shape), 0, 255).astype(np.uint8)
    return arr if mode == "RGB" else arr[..., 0]


def folder(root, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """An ImageFolder of PNGs (RGB and greyscale): relative path -> the pixels as RGB."""
    rng = np.random.default_rng(seed)
    want = {}
    for i in range(n):
        cls = f"class{i % 3}"
        (root / cls).mkdir(parents=True, exist_ok=True)
        mode = "L" if i % 4 == 3 else "RGB"
        arr = photo(rng, int(rng.integers(33, 120)), int(rng.integers(33, 120)), mode)
        Image.fromarray(arr).save(root / cls / f"{i:03d}.png")
        want[f"{cls}/{i:03d}.png"] = arr if mode == "RGB" else np.repeat(arr[..., None], 3, -1)
    return want


def test_ingest_jpeg2000_round_trips_pixel_exact_through_both_iterators(tmp_path):
    want = folder(tmp_path / "src", 24)
    db = tmp_path / "lossless.db"
    subprocess.run([sys.executable, "-m", "dataferry.schema.cli", "ingest", str(tmp_path / "src"), "--dataset", "seg",
                    "--store", f"sqlite:{db}", "--format", "jpeg2000", "--quiet", "--workers", "1"],
                   check=True, capture_output=True, text=True)
    paths = _paths(db)
    assert len(paths) == 24
    iterators = [lambda ld: TorchIterator(ld, None, workers=2)]
    if _has_dali():
        from dataferry.client._dali import DaliIterator, DaliOptions

        iterators.append(lambda ld: DaliIterator(ld, None, options=DaliOptions(device="cpu", num_threads=2)))
    for make in iterators:
        with Loader(f"sqlite:{db}", "seg", batch_size=10) as loader:
            it = make(loader)
            try:
                seen = 0
                for batch in it:
                    for sid, img in zip(batch.ids.tolist(), batch.images):
                        assert np.array_equal(img.numpy(), want[paths[sid]]), (make, paths[sid])
                        seen += 1
            finally:
                it.close()
        assert seen == 24


def _paths(db) -> dict[int, str]:
    import sqlite3

    con = sqlite3.connect(db)
    try:
        rows = con.execute("SELECT id, path, format FROM sample_meta WHERE dataset = 'seg'").fetchall()
    finally:
        con.close()
    assert {fmt for _, _, fmt in rows} == {"JPEG2000"}  # the metadata names the stored format
    return {sid: path for sid, path, _ in rows}


def _has_dali() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("path", ["torch", "dali"])
def test_jpeg2000_masks_move_with_their_images(path):
    samples = coord_samples(24, format="jpeg2000")
    assert all(s.data[:12] == b"\x00\x00\x00\x0cjP  \r\n\x87\n" for s in samples)
    t = TrainTransform(size=32, scale=(0.2, 1.0))
    if path == "torch":
        def make(ld):
            return TorchIterator(ld, t, targets="mask", workers=2)
    else:
        pytest.importorskip("nvidia.dali")
        from dataferry.client._dali import DaliIterator, DaliOptions

        def make(ld):
            return DaliIterator(ld, t, targets="mask", options=DaliOptions(device="cpu", num_threads=2))
    (batches,) = run_epochs(make, MemorySource("ds", samples), batch_size=12)
    assert sum(len(b) for b in batches) == 24
    check_coordinates(batches, samples, t)


def test_headers_and_mask_checks_read_jp2():
    arr = coord_image(37, 91)
    img = validate_bytes("x", png(arr), ValidateOptions(format="jp2")).data
    assert image_size(img) == (37, 91)
    mask = encode_mask(arr[..., 0], "jpeg2000")
    check_mask(mask, (37, 91), "m")
    with pytest.raises(InvalidImage, match="mask is 91x37, its image 90x37"):
        check_mask(mask, (37, 90), "m")
    with pytest.raises(InvalidImage, match="single-channel, not a JP2 of 3 component"):
        check_mask(img, (37, 91), "m")
    with pytest.raises(ConfigError, match="png or jpeg2000"):
        encode_mask(arr[..., 0], "jpeg")
    with pytest.raises(ConfigError, match="use jpeg, png or jpeg2000"):
        ValidateOptions(format="webp")
