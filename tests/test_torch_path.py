"""The PyTorch path (Pillow in threads) and the transforms both paths share.

The helpers here (sample makers, the coordinate-image check) are reused by
``test_dali.py``, so the two paths are held to the same checks.
"""

from __future__ import annotations

import io
import queue
import time
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from PIL import Image  # noqa: E402

from dataferry.client import Loader, MemorySource, PlanOptions  # noqa: E402
from dataferry.client._imagebatch import ImageBatch  # noqa: E402
from dataferry.client._torch import TorchIterator  # noqa: E402
from dataferry.client._transforms import (  # noqa: E402
    EvalTransform,
    TrainTransform,
    crop_windows,
    decode_multilabel,
    image_size,
)
from dataferry.schema import Sample, encode_mask, encode_multilabel  # noqa: E402
from dataferry.schema._errors import ConfigError, DataferryError, InvalidImage  # noqa: E402
from dataferry.schema._validate import ValidateOptions, validate_bytes  # noqa: E402

# --- sample makers (shared with test_dali.py) -----------------------------------------------


def jpeg(rng: np.random.Generator, h: int, w: int) -> bytes:
    """A smooth random JPEG (so decoders agree closely) of ``w x h``."""
    low = rng.integers(0, 256, (h // 8 + 2, w // 8 + 2, 3), dtype=np.uint8)
    im = Image.fromarray(low).resize((w, h), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def jpeg_samples(n: int, *, seed: int = 0, classes: int = 5) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [Sample(i, i % classes, jpeg(rng, int(rng.integers(40, 90)), int(rng.integers(40, 90)))) for i in range(n)]


def coord_image(h: int, w: int) -> np.ndarray:
    """R = x and G = y, scaled to 0..255; B constant."""
    yy, xx = np.mgrid[0:h, 0:w]
    return np.stack([xx * 255 // (w - 1), yy * 255 // (h - 1), np.full_like(xx, 128)], -1).astype(np.uint8)


def png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def coord_samples(n: int, *, seed: int = 1, format: str = "png") -> list[Sample]:
    """Lossless coordinate images, image and mask as PNG (or ``format="jpeg2000"``:
    JP2, as ``ingest --format jpeg2000`` stores them); the mask is the R channel
    (so it must move with the image)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        arr = coord_image(int(rng.integers(60, 140)), int(rng.integers(60, 140)))
        data = png(arr)
        if format != "png":
            data = validate_bytes("coords", data, ValidateOptions(format=format)).data
        out.append(Sample(i, 0, data, encode_mask(arr[..., 0], format)))
    return out


def check_coordinates(batches: list[ImageBatch], samples: list[Sample], transform, *, seed: int = 0) -> int:
    """Every image shows exactly its crop window (and flip); every mask matches its image.

    Returns how many samples were flipped."""
    by_id = {s.id: s for s in samples}
    flipped = 0
    std, mean = np.asarray(transform.std)[:, None, None], np.asarray(transform.mean)[:, None, None]
    for b in batches:
        hw = np.array([image_size(by_id[i].data) for i in b.ids.tolist()])
        windows, flips = crop_windows(transform, hw, b.ids.numpy(), seed=seed, epoch=b.epoch)
        imgs = b.images.cpu().numpy()
        masks = b.targets.cpu().numpy().astype(np.float64)
        for k in range(len(b)):
            rgb = (imgs[k] * std + mean) * 255  # back to 0..255, [3, S, S]
            s = rgb.shape[-1]
            x, y, w, h = windows[k]
            (H, W), j = hw[k], np.arange(s)
            want_r = 255 * (x + (j + 0.5) * w / s - 0.5) / (W - 1)
            want_g = 255 * (y + (j + 0.5) * h / s - 0.5) / (H - 1)
            if flips[k]:
                want_r = want_r[::-1]
                flipped += 1
            assert np.abs(rgb[0].mean(0) - want_r).mean() < 2.5, f"sample {b.ids[k]}: wrong x window"
            assert np.abs(rgb[1].mean(1) - want_g).mean() < 2.5, f"sample {b.ids[k]}: wrong y window"
            assert np.abs(rgb[0] - masks[k]).mean() < 2.0, f"sample {b.ids[k]}: mask not aligned"
            # the check has teeth: a mask flipped against its image is far off
            assert np.abs(rgb[0] - masks[k][:, ::-1]).mean() > 4 * np.abs(rgb[0] - masks[k]).mean() + 1
    return flipped


def run_epochs(make_iter, source, *, epochs: int = 1, batch_size: int = 32, **loader_kw) -> list[list[ImageBatch]]:
    with Loader(source, source.dataset, batch_size=batch_size, **loader_kw) as loader:
        with make_iter(loader) as it:
            return [list(it) for _ in range(epochs)]


def check_epochs(out: list[list[ImageBatch]], samples: list[Sample], sizes: list[int]) -> None:
    labels = {s.id: s.label for s in samples}
    for epoch, batches in enumerate(out):
        assert [len(b) for b in batches] == sizes
        ids = [i for b in batches for i in b.ids.tolist()]
        assert sorted(ids) == sorted(labels)  # exactly once, nothing padded or repeated
        for b in batches:
            assert b.epoch == epoch
            assert b.ids.dtype == torch.int64 and b.labels.dtype == torch.int64
            assert b.labels.tolist() == [labels[i] for i in b.ids.tolist()]


# --- the iterator -------------------------------------------------------------------------------


def test_epochs_keep_the_partial_last_batch_and_every_id_once():
    samples = jpeg_samples(103)
    out = run_epochs(lambda ld: TorchIterator(ld, TrainTransform(size=24), workers=2), MemorySource("ds", samples),
                     epochs=2)
    check_epochs(out, samples, [32, 32, 32, 7])
    b = out[1][-1]
    assert b.images.shape == (7, 3, 24, 24) and b.images.dtype == torch.float32 and b.targets is None
    assert -3 < float(b.images.mean()) < 3


def test_iter_walks_consecutive_epochs_and_get_nowait_never_blocks():
    samples = jpeg_samples(70)
    with Loader(MemorySource("ds", samples, latency=0.05), "ds", batch_size=32) as loader:
        with TorchIterator(loader, TrainTransform(size=16), workers=2) as it:
            it1, it2 = iter(it), iter(it)
            assert (it1.epoch, it2.epoch) == (0, 1)
            first = list(it1)
            assert list(it1) == []  # exhausted for good
            check_epochs([first, list(it2)], samples, [32, 32, 6])
            ep = iter(it)
            with pytest.raises(queue.Empty):  # the first request is still on its way
                ep.get_nowait()
            got = []
            while True:
                try:
                    got.append(ep.get_nowait())
                except queue.Empty:
                    time.sleep(0.01)
                except StopIteration:
                    break
            assert sorted(i for b in got for i in b.ids.tolist()) == sorted(s.id for s in samples)
            assert {b.epoch for b in got} == {2}


def test_completion_order_and_drop_last():
    samples = jpeg_samples(70)
    out = run_epochs(lambda ld: TorchIterator(ld, EvalTransform(size=16, resize=20)), MemorySource("ds", samples),
                     batch_size=32, drop_last=True)
    assert [len(b) for b in out[0]] == [32, 32]


def test_decode_only_matches_pillow_exactly():
    samples = jpeg_samples(20)
    (batches,) = run_epochs(lambda ld: TorchIterator(ld, None, workers=3), MemorySource("ds", samples), batch_size=8)
    by_id = {s.id: s for s in samples}
    for b in batches:
        assert isinstance(b.images, list)
        for i, img in zip(b.ids.tolist(), b.images):
            want = np.asarray(Image.open(io.BytesIO(by_id[i].data)).convert("RGB"))
            assert img.dtype == torch.uint8 and np.array_equal(img.numpy(), want)


def test_eval_transform_is_resize_then_centre_crop():
    """The same view as torchvision's Resize(resize) + CenterCrop(size): one resampling of the
    window instead of two, and torchvision rounds the crop offset in resized pixels, so the
    two differ by a pixel's shift at most; on coordinate images that is a few levels."""
    samples = coord_samples(12)
    t = EvalTransform(size=32, resize=40)
    (batches,) = run_epochs(lambda ld: TorchIterator(ld, t), MemorySource("ds", samples), batch_size=12)
    by_id = {s.id: s for s in samples}
    b = batches[0]
    for k, i in enumerate(b.ids.tolist()):
        im = Image.open(io.BytesIO(by_id[i].data)).convert("RGB")
        w, h = im.size
        nw, nh = (40, round(h * 40 / w)) if w <= h else (round(w * 40 / h), 40)
        ref = np.asarray(im.resize((nw, nh), Image.Resampling.BILINEAR), np.float64)
        top, left = round((nh - 32) / 2), round((nw - 32) / 2)
        ref = ref[top : top + 32, left : left + 32].transpose(2, 0, 1) / 255
        got = b.images[k].numpy() * np.asarray(t.std)[:, None, None] + np.asarray(t.mean)[:, None, None]
        assert np.abs(got - ref).mean() * 255 < 6


def test_mask_moves_with_the_image_under_crop_and_flip():
    samples = coord_samples(40)
    t = TrainTransform(size=32, scale=(0.2, 1.0))
    (batches,) = run_epochs(lambda ld: TorchIterator(ld, t, targets="mask"), MemorySource("ds", samples), batch_size=16)
    assert batches[0].targets.dtype == torch.uint8 and batches[0].targets.shape == (16, 32, 32)
    flipped = check_coordinates(batches, samples, t)
    assert 5 <= flipped <= 35


def test_mask_under_eval_and_decode_only():
    samples = coord_samples(10)
    t = EvalTransform(size=24, resize=28)
    (batches,) = run_epochs(lambda ld: TorchIterator(ld, t, targets="mask"), MemorySource("ds", samples), batch_size=10)
    assert check_coordinates(batches, samples, t) == 0
    (raw,) = run_epochs(lambda ld: TorchIterator(ld, None, targets="mask"), MemorySource("ds", samples), batch_size=10)
    for img, mask in zip(raw[0].images, raw[0].targets):
        assert torch.equal(img[..., 0], mask)


def test_multilabel_round_trip():
    rng = np.random.default_rng(3)
    vectors = {i: (rng.random(7) < 0.3).astype(np.float32) for i in range(30)}
    vectors[4] = np.array([0.1, 0.9, 0, 0, 0.5, 0, 1], np.float32)  # soft labels survive too
    samples = [Sample(s.id, 0, s.data, encode_multilabel(vectors[s.id])) for s in jpeg_samples(30)]
    (batches,) = run_epochs(lambda ld: TorchIterator(ld, TrainTransform(size=16), targets="multilabel"),
                            MemorySource("ds", samples), batch_size=8)
    for b in batches:
        assert b.targets.dtype == torch.float32 and b.targets.shape == (len(b), 7)
        for i, row in zip(b.ids.tolist(), b.targets.numpy()):
            assert np.array_equal(row, vectors[i])


def test_works_under_a_torch_dataloader():
    samples = jpeg_samples(40)
    with Loader(MemorySource("ds", samples), "ds", batch_size=16, order="input") as loader:
        it = TorchIterator(loader, EvalTransform(size=16, resize=16))
        dl = torch.utils.data.DataLoader(it, batch_size=None, num_workers=0)
        assert len(dl) == 3
        for _ in range(2):
            got = list(dl)
            assert [len(b) for b in got] == [16, 16, 8]
            assert sorted(i for b in got for i in b.ids.tolist()) == list(range(40))
        it.close()
        it.close()  # idempotent


def check_map(make_iter) -> None:
    """``make_iter(loader, map)``: a map that negates the images and adds 100 to the labels
    changes exactly those, batch for batch (shared with test_dali.py)."""
    samples = jpeg_samples(20)
    kw = {"batch_size": 8, "order": "input"}
    seen = []

    def negate(b: ImageBatch) -> ImageBatch:
        seen.append(b.epoch)
        return replace(b, images=-b.images, labels=b.labels + 100)

    (plain,) = run_epochs(lambda ld: make_iter(ld, None), MemorySource("ds", samples), **kw)
    mapped = run_epochs(lambda ld: make_iter(ld, negate), MemorySource("ds", samples), epochs=2, **kw)
    assert seen == [0] * 3 + [1] * 3
    for x, y in zip(plain, mapped[0]):
        assert float(x.images.abs().mean()) > 0.1  # so the negation shows
        assert torch.equal(y.images, -x.images) and torch.equal(y.labels, x.labels + 100)
        assert torch.equal(y.ids, x.ids)
    with Loader(MemorySource("ds", samples), "ds", batch_size=8) as loader:
        with pytest.raises(ConfigError, match="map must be a function"):
            make_iter(loader, "negate")
        with make_iter(loader, lambda b: b.images) as it, pytest.raises(ConfigError, match="not an ImageBatch"):
            next(it)
    with pytest.raises(ZeroDivisionError) as info:
        run_epochs(lambda ld: make_iter(ld, lambda b: 1 / 0), MemorySource("ds", samples), **kw)
    assert "map=" in info.value.__notes__[0] and "dataset 'ds', epoch 0" in info.value.__notes__[0]


def test_map_runs_after_the_stock_transform():
    check_map(lambda ld, f: TorchIterator(ld, EvalTransform(16, 20), workers=2, map=f))


def test_ranks_read_disjoint_shards():
    samples = jpeg_samples(50)
    seen = []
    for rank in range(2):
        (batches,) = run_epochs(lambda ld: TorchIterator(ld, EvalTransform(16, 16)), MemorySource("ds", samples),
                                batch_size=10, plan=PlanOptions(rank=rank, world_size=2))
        seen.append({i for b in batches for i in b.ids.tolist()})
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(50))


def test_state_dict_leaves_out_batches_in_flight():
    samples = jpeg_samples(100)
    src = MemorySource("ds", samples)
    with Loader(src, "ds", batch_size=10) as loader, TorchIterator(loader, EvalTransform(16, 16), decode_depth=3) as it:
        first = [next(it), next(it)]
        state = it.state_dict()  # the loader itself has handed out more than these two batches
    taken = {i for b in first for i in b.ids.tolist()}
    with Loader(src, "ds", batch_size=10) as loader, TorchIterator(loader, EvalTransform(16, 16)) as it:
        it.load_state_dict(state)
        rest = [i for b in it for i in b.ids.tolist()]
    assert len(rest) == len(set(rest)) and taken | set(rest) == set(range(100)) and not taken & set(rest)


def test_state_dict_at_the_tail_of_an_epoch():
    """The loader may have ended the epoch while its last batches are still decoding."""
    samples = jpeg_samples(30)
    src = MemorySource("ds", samples)
    with Loader(src, "ds", batch_size=10) as loader, TorchIterator(loader, EvalTransform(16, 16), decode_depth=4) as it:
        first = next(it)
        state = it.state_dict()
    assert state["epoch"] == 0
    with Loader(src, "ds", batch_size=10) as loader, TorchIterator(loader, EvalTransform(16, 16)) as it:
        it.load_state_dict(state)
        rest = [i for b in it for i in b.ids.tolist()]
    assert sorted(rest + first.ids.tolist()) == list(range(30))


# --- transforms ---------------------------------------------------------------------------------


def test_crop_windows_follow_random_resized_crop():
    t = TrainTransform(size=8, scale=(0.1, 0.9), ratio=(0.5, 2.0))
    hw = np.array([[300, 400]] * 2000)
    ids = np.arange(2000, dtype=np.int64)
    win, flips = crop_windows(t, hw, ids, seed=7, epoch=3)
    x, y, w, h = win.T
    assert (x >= 0).all() and (y >= 0).all() and (x + w <= 400).all() and (y + h <= 300).all()
    area = w * h / (300 * 400)
    assert area.min() > 0.09 and area.max() < 0.91
    assert (w / h).min() > 0.45 and (w / h).max() < 2.2
    assert 0.45 < flips.mean() < 0.55 and x.std() > 20 and y.std() > 20
    # a pure function of (seed, epoch, id): batch composition and order do not matter
    again, f2 = crop_windows(t, hw[::-1][:500], ids[::-1][:500], seed=7, epoch=3)
    assert np.array_equal(again, win[::-1][:500]) and np.array_equal(f2, flips[::-1][:500])
    other, _ = crop_windows(t, hw, ids, seed=7, epoch=4)
    assert (other != win).any(axis=1).mean() > 0.9


def test_crop_windows_fall_back_to_a_centred_crop():
    t = TrainTransform(size=8, scale=(0.9, 1.0), ratio=(1.0, 1.0))
    win, _ = crop_windows(t, np.array([[10, 1000]]), np.array([5]), seed=0, epoch=0)
    assert win.tolist() == [[495, 0, 10, 10]]
    ev, flips = crop_windows(EvalTransform(224, 256), np.array([[512, 1024]]), np.array([1]), seed=0, epoch=0)
    assert ev.tolist() == [[288, 32, 448, 448]] and not flips.any()


def test_image_size_reads_headers():
    rng = np.random.default_rng(0)
    assert image_size(jpeg(rng, 33, 57)) == (33, 57)
    assert image_size(encode_mask(np.zeros((7, 9), np.uint8))) == (7, 9)
    buf = io.BytesIO()
    Image.new("RGB", (5, 4)).save(buf, "BMP")
    assert image_size(buf.getvalue()) == (4, 5)  # Pillow fallback
    with pytest.raises(InvalidImage, match="sample 9"):
        image_size(b"not an image", "dataset 'x' sample 9")


def test_bad_targets_and_options_are_named():
    good = jpeg_samples(4)
    no_mask = MemorySource("ds", good)
    with pytest.raises(DataferryError, match=r"dataset 'ds' sample \d: no mask target"):
        run_epochs(lambda ld: TorchIterator(ld, EvalTransform(16, 16), targets="mask"), no_mask)
    palette = io.BytesIO()
    Image.fromarray(np.zeros((50, 50), np.uint8)).convert("P").save(palette, "PNG")
    s = good[0]
    bad = MemorySource("ds", [Sample(s.id, 0, s.data, palette.getvalue())])
    with pytest.raises(InvalidImage, match="single-channel"):
        run_epochs(lambda ld: TorchIterator(ld, EvalTransform(16, 16), targets="mask"), bad)
    corrupt = MemorySource("ds", [Sample(3, 0, s.data[:200])])
    with pytest.raises(InvalidImage, match="sample 3"):
        run_epochs(lambda ld: TorchIterator(ld, EvalTransform(16, 16)), corrupt)
    with pytest.raises(InvalidImage, match="one length"):
        decode_multilabel([b"\0" * 8, b"\0" * 12], [1, 2], "ds")
    for make in (lambda: TrainTransform(size=0), lambda: TrainTransform(scale=(0.5, 0.2)),
                 lambda: EvalTransform(size=256, resize=224), lambda: TrainTransform(flip=2)):
        with pytest.raises(ConfigError):
            make()
    with Loader(no_mask, "ds") as loader:
        with pytest.raises(ConfigError, match="targets"):
            TorchIterator(loader, targets="boxes")
        with pytest.raises(ConfigError, match="prefetch"):
            TorchIterator(loader, decode_depth=0)


def test_the_iterators_old_prefetch_keyword_still_works_with_a_deprecation_warning():
    from dataferry.client import DaliOptions

    with Loader(MemorySource("ds", jpeg_samples(20)), "ds", batch_size=10) as loader:
        with pytest.warns(DeprecationWarning, match="decode_depth"):
            it = TorchIterator(loader, EvalTransform(16, 16), prefetch=3)
        with it:
            assert it.decode_depth == 3 and len(list(it)) == 2
    with pytest.warns(DeprecationWarning, match="decode_depth"):
        assert DaliOptions(device="cpu", prefetch=4).decode_depth == 4
