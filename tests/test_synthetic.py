"""The synthetic ImageNet-like generator: realistic sizes, deterministic, fast."""

from __future__ import annotations

import time

import numpy as np
import pytest
from PIL import Image

from dataferry.schema import ConfigError
from dataferry.schema._scan import scan
from dataferry.schema._synthetic import class_names, make_synthetic


def _files(root):
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_tree_layout_labels_and_dimensions(tmp_path):
    syn = make_synthetic(tmp_path, 120, classes=7, seed=3)
    assert syn.label_names == class_names(7) == tuple(f"class_00{k}" for k in range(7))
    src = scan(tmp_path)
    assert src.label_names == syn.label_names and len(src.files) == 120 and not src.skipped
    for f in src.files:
        index = int(f.relpath.rsplit("/", 1)[1].split(".")[0])
        assert f.label == index % 7
    sizes = []
    for path in _files(tmp_path):
        with Image.open(path) as im:
            im.load()
            assert im.format == "JPEG" and im.mode == "RGB"
            assert 400 <= max(im.size) <= 640 and 240 <= min(im.size) <= 640
            sizes.append(im.size)
    aspects = {round(w / h, 2) for w, h in sizes}
    assert len(aspects) > 5 and any(w < h for w, h in sizes) and any(w > h for w, h in sizes)
    assert syn.total_bytes == sum(p.stat().st_size for p in _files(tmp_path))


@pytest.mark.parametrize("quality", [90, 75])
def test_mean_size_is_about_110_kb(tmp_path, quality):
    syn = make_synthetic(tmp_path, 200, seed=11, quality=quality)
    assert 0.85 * 110_000 <= syn.mean_bytes <= 1.15 * 110_000, syn.mean_bytes
    sizes = np.array([p.stat().st_size for p in _files(tmp_path)])
    assert sizes.std() / sizes.mean() > 0.1  # varied, like real photos


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = make_synthetic(tmp_path / "a", 20, seed=5, workers=1)
    b = make_synthetic(tmp_path / "b", 20, seed=5, workers=3)
    c = make_synthetic(tmp_path / "c", 20, seed=6)
    fa, fb, fc = (_files(tmp_path / x) for x in "abc")
    assert [p.read_bytes() for p in fa] == [p.read_bytes() for p in fb]
    assert a.total_bytes == b.total_bytes
    assert all(x.read_bytes() != y.read_bytes() for x, y in zip(fa, fc)) and c.num_images == 20


def test_a_prefix_of_a_bigger_set_is_the_smaller_set(tmp_path):
    make_synthetic(tmp_path / "small", 10, seed=2)
    make_synthetic(tmp_path / "big", 30, seed=2)
    for p in _files(tmp_path / "small"):
        assert p.read_bytes() == (tmp_path / "big" / p.relative_to(tmp_path / "small")).read_bytes()


@pytest.mark.slow
def test_two_thousand_images_well_under_a_minute(tmp_path):
    t0 = time.perf_counter()
    syn = make_synthetic(tmp_path, 2000, seed=1)
    elapsed = time.perf_counter() - t0
    assert syn.num_images == 2000 and elapsed < 40, elapsed


@pytest.mark.parametrize(
    "kwargs, match",
    [({"num_images": -1}, "must be >= 0"), ({"classes": 0}, "classes"), ({"quality": 101}, "quality"),
     ({"target_kb": 0}, "target_kb")],
)
def test_bad_arguments(tmp_path, kwargs, match):
    args = {"num_images": 1, **kwargs}
    with pytest.raises(ConfigError, match=match):
        make_synthetic(tmp_path, args.pop("num_images"), **args)
