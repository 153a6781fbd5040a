"""The DALI path on the CPU (CI has no GPU), held to the PyTorch path's checks.

GPU-only tests run where DALI and torch both see a CUDA device; everywhere
else ``bench/gpu_check.py`` is tested for saying so (its PSNR check and
``--e2e``: ``test_gpu_check.py``).
"""

from __future__ import annotations

import gc
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nvidia.dali")

from nvidia.dali import fn  # noqa: E402
from PIL import Image  # noqa: E402
from test_torch_path import (  # noqa: E402
    check_coordinates,
    check_epochs,
    check_map,
    coord_samples,
    jpeg_samples,
    run_epochs,
)

from dataferry.client import Loader, MemorySource, SampleFailed  # noqa: E402
from dataferry.client._dali import DaliIterator, DaliOptions, dali_gpu_count  # noqa: E402
from dataferry.client._torch import TorchIterator  # noqa: E402
from dataferry.client._transforms import EvalTransform, TrainTransform  # noqa: E402
from dataferry.schema import IdList, Sample, encode_multilabel  # noqa: E402
from dataferry.schema._errors import ConfigError, DataferryError, UndecodableSample  # noqa: E402

CPU = DaliOptions(device="cpu", num_threads=2)
GPU = dali_gpu_count() > 0 and torch.cuda.is_available()


def dali(transform, **kw):
    return lambda loader: DaliIterator(loader, transform, options=kw.pop("options", CPU), **kw)


def test_decode_matches_pillow():
    samples = jpeg_samples(24)
    (batches,) = run_epochs(dali(None), MemorySource("ds", samples), batch_size=10)
    by_id = {s.id: s for s in samples}
    assert [len(b) for b in batches] == [10, 10, 4]
    for b in batches:
        for i, img in zip(b.ids.tolist(), b.images):
            want = np.asarray(Image.open(io.BytesIO(by_id[i].data)).convert("RGB"), np.int16)
            assert img.dtype == torch.uint8 and img.shape == want.shape
            assert np.abs(img.numpy().astype(np.int16) - want).mean() < 2  # both are libjpeg-turbo


def test_epochs_keep_the_partial_last_batch_and_every_id_once():
    samples = jpeg_samples(103)
    out = run_epochs(dali(TrainTransform(size=24)), MemorySource("ds", samples), epochs=2)
    check_epochs(out, samples, [32, 32, 32, 7])
    last = out[1][-1]
    assert last.images.shape == (7, 3, 24, 24) and last.images.dtype == torch.float32
    assert last.images.device.type == "cpu" and last.targets is None


def test_an_epoch_shorter_than_the_prefetch_queue():
    samples = jpeg_samples(5)
    out = run_epochs(dali(EvalTransform(16, 16), options=DaliOptions(device="cpu", decode_depth=4)),
                     MemorySource("ds", samples), epochs=3, batch_size=4)
    check_epochs(out, samples, [4, 1])


@pytest.mark.parametrize("transform", [TrainTransform(size=32, scale=(0.2, 1.0)), EvalTransform(size=32, resize=36)])
def test_dali_and_torch_paths_agree(transform):
    """Same crop windows and flips (keyed by seed, epoch, id), so the same pixels to resampling error."""
    samples = jpeg_samples(40)
    kw = {"batch_size": 16, "order": "input"}
    (a,) = run_epochs(dali(transform), MemorySource("ds", samples), **kw)
    (b,) = run_epochs(lambda ld: TorchIterator(ld, transform), MemorySource("ds", samples), **kw)
    for x, y in zip(a, b):
        assert torch.equal(x.ids, y.ids) and torch.equal(x.labels, y.labels)
        diff = (x.images - y.images).abs().mean(dim=(1, 2, 3)) * 0.226 * 255  # about uint8 levels
        assert float(diff.max()) < 1.5


def test_mask_moves_with_the_image_under_crop_and_flip():
    samples = coord_samples(40)
    t = TrainTransform(size=32, scale=(0.2, 1.0))
    (batches,) = run_epochs(dali(t, targets="mask"), MemorySource("ds", samples), batch_size=16)
    assert batches[0].targets.dtype == torch.uint8 and batches[0].targets.shape == (16, 32, 32)
    assert 5 <= check_coordinates(batches, samples, t) <= 35


def test_mask_without_a_transform():
    samples = coord_samples(6)
    (batches,) = run_epochs(dali(None, targets="mask"), MemorySource("ds", samples), batch_size=6)
    for img, mask in zip(batches[0].images, batches[0].targets):
        assert torch.equal(img[..., 0], mask)


def test_multilabel_passes_through():
    vectors = {i: np.eye(5, dtype=np.float32)[i % 5] * (1 + i) for i in range(20)}
    samples = [Sample(s.id, 1, s.data, encode_multilabel(vectors[s.id])) for s in jpeg_samples(20)]
    (batches,) = run_epochs(dali(TrainTransform(size=16), targets="multilabel"), MemorySource("ds", samples),
                            batch_size=8)
    for b in batches:
        assert b.targets.shape == (len(b), 5)
        for i, row in zip(b.ids.tolist(), b.targets.numpy()):
            assert np.array_equal(row, vectors[i])


def test_map_runs_after_dali():
    check_map(lambda ld, f: DaliIterator(ld, EvalTransform(16, 20), options=CPU, map=f))


def test_graph_adds_operators_after_the_stock_ones():
    """A vertical flip and a constant added inside the pipeline show up exactly in the output."""
    samples = jpeg_samples(20)
    t = TrainTransform(size=24)
    kw = {"batch_size": 8, "order": "input"}
    (plain,) = run_epochs(dali(t), MemorySource("ds", samples), **kw)
    ours_graph = dali(t, graph=lambda images: fn.flip(images, horizontal=0, vertical=1) + 5.0)
    (ours,) = run_epochs(ours_graph, MemorySource("ds", samples), **kw)
    for x, y in zip(plain, ours):
        assert torch.equal(x.ids, y.ids) and y.images.shape == x.images.shape
        assert torch.allclose(y.images, x.images.flip(-2) + 5.0)
    (raw,) = run_epochs(dali(None, graph=lambda images: 255 - images), MemorySource("ds", samples), **kw)
    (raw_plain,) = run_epochs(dali(None), MemorySource("ds", samples), **kw)
    for x, y in zip(raw_plain, raw):
        for a, b in zip(x.images, y.images):
            assert a.shape == b.shape and torch.equal(b.to(torch.int16), 255 - a.to(torch.int16))


def test_graph_sees_the_masks_too():
    samples = coord_samples(12)
    t = TrainTransform(size=32, scale=(0.2, 1.0))

    def upside_down(images, masks):
        return fn.flip(images, horizontal=0, vertical=1), fn.flip(masks, horizontal=0, vertical=1)

    (plain,) = run_epochs(dali(t, targets="mask"), MemorySource("ds", samples), batch_size=12)
    (flipped,) = run_epochs(dali(t, targets="mask", graph=upside_down), MemorySource("ds", samples), batch_size=12)
    assert torch.equal(flipped[0].targets, plain[0].targets.flip(-2))
    assert torch.allclose(flipped[0].images, plain[0].images.flip(-2))


def test_a_bad_graph_is_named():
    with Loader(MemorySource("ds", jpeg_samples(4)), "ds", batch_size=4) as loader:
        with pytest.raises(ConfigError, match=r"graph=.* must return \(images, masks\) as DALI data nodes"):
            DaliIterator(loader, EvalTransform(16, 16), targets="mask", options=CPU, graph=lambda images, masks: images)
        with pytest.raises(ConfigError, match="must return images as DALI data nodes"):
            DaliIterator(loader, EvalTransform(16, 16), options=CPU, graph=lambda images: np.zeros(3))
        with pytest.raises(ConfigError, match="graph must be a function"):
            DaliIterator(loader, options=CPU, graph=3)
        with pytest.raises(TypeError) as info:
            DaliIterator(loader, options=CPU, graph=lambda images, masks: (images, masks))
        assert "called with images" in info.value.__notes__[0]


class _FreshBytes(MemorySource):
    """Answers with new buffers each time, so only the pipeline's side keeps
    the memory DALI reads without copying (no_copy) alive: the in-flight
    queue (DALI 2.4 also holds a reference while a batch is queued, which its
    documented contract does not promise)."""

    async def fetch(self, dataset, ids):
        async for s in super().fetch(dataset, ids):
            yield Sample(s.id, s.label, bytearray(s.data), s.target) if isinstance(s, Sample) else s


def test_no_copy_buffers_live_until_their_outputs_are_out():
    samples = jpeg_samples(60)
    src = _FreshBytes("ds", samples)
    by_id = {s.id: s for s in samples}
    with Loader(src, "ds", batch_size=8) as loader:
        it = DaliIterator(loader, None, options=DaliOptions(device="cpu", decode_depth=3))
        for _ in range(2):
            for b in it:
                gc.collect()
                junk = [bytes(50_000) for _ in range(50)]  # reuse any freed memory
                for i, img in zip(b.ids.tolist(), b.images):
                    want = np.asarray(Image.open(io.BytesIO(by_id[i].data)).convert("RGB"), np.int16)
                    assert np.abs(img.numpy().astype(np.int16) - want).mean() < 2
                del junk
            assert not it._feeder.inflight
        it.close()


def test_state_dict_leaves_out_batches_inside_dali():
    samples = jpeg_samples(100)
    src = MemorySource("ds", samples)
    opts = DaliOptions(device="cpu", decode_depth=3)
    with Loader(src, "ds", batch_size=10) as loader, DaliIterator(loader, EvalTransform(16, 16), options=opts) as it:
        first = [next(it), next(it)]
        assert len(it._feeder.inflight) >= 2  # DALI has pulled ahead of the consumer
        state = it.state_dict()
    taken = {i for b in first for i in b.ids.tolist()}
    with Loader(src, "ds", batch_size=10) as loader, DaliIterator(loader, EvalTransform(16, 16), options=opts) as it:
        it.load_state_dict(state)
        rest = [i for b in it for i in b.ids.tolist()]
        assert len(it) == 10
    assert len(rest) == len(set(rest)) and taken | set(rest) == set(range(100)) and not taken & set(rest)


def test_loader_errors_come_through_dali_unchanged():
    samples = jpeg_samples(10)
    ids = IdList(np.array([0, 1, 999], np.int64), np.zeros(3, np.int32))
    with Loader(MemorySource("ds", samples), "ds", ids=ids, batch_size=2) as loader:
        with DaliIterator(loader, EvalTransform(16, 16), options=CPU) as it:
            with pytest.raises(SampleFailed, match="999"):
                list(it)


def test_a_corrupt_jpeg_is_named_by_dataset_and_id():
    """DALI fails the whole batch; the sample at fault is named (found by decoding the batch on the CPU)."""
    good = jpeg_samples(4)
    bad = good[:3] + [Sample(3, 0, good[3].data[:300])]
    with pytest.raises(UndecodableSample, match=r"dataset 'ds' sample 3: failed to decode: .*\(DALI: "):
        run_epochs(dali(None), MemorySource("ds", bad), batch_size=4)


def test_device_choice_and_options():
    assert DaliOptions().resolve(torch) == (("gpu", torch.cuda.current_device()) if GPU else ("cpu", None))
    assert DaliOptions(device="cpu", device_id=3).resolve(torch) == ("cpu", None)
    if not GPU:
        with pytest.raises(ConfigError, match="no CUDA device|no CUDA"):
            DaliOptions(device="gpu").resolve(torch)
    for bad in ({"device": "tpu"}, {"decode_depth": 0}, {"num_threads": 0}, {"device_id": -1}, {"hw_decoder_load": 2}):
        with pytest.raises(ConfigError):
            DaliOptions(**bad)
    with Loader(MemorySource("ds", jpeg_samples(2)), "ds") as loader:
        it = DaliIterator(loader, options=CPU)
        assert isinstance(it, torch.utils.data.IterableDataset) and it.pipeline is not None
        it.close()
        it.close()
        assert it.pipeline is None
        with pytest.raises(DataferryError, match="closed"):
            next(it)


def test_gpu_check_says_when_there_is_no_gpu(capsys):
    from dataferry.bench import gpu_check

    if GPU:
        pytest.skip("this machine has a GPU")
    assert gpu_check.main([]) == gpu_check.NO_GPU
    assert "no usable GPU" in capsys.readouterr().err
    assert gpu_check.main(["--allow-cpu", "--images", "8", "--batch", "8", "--passes", "1", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert "NO GPU" in out and "images/s" in out and "decoder vs Pillow on 8 JPEGs: PSNR min inf dB" in out


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU visible to DALI and torch")
def test_mixed_decode_on_the_gpu():
    samples = coord_samples(40)
    t = TrainTransform(size=32, scale=(0.2, 1.0))
    opts = DaliOptions(device="gpu")
    (batches,) = run_epochs(dali(t, targets="mask", options=opts), MemorySource("ds", samples), batch_size=16)
    assert [len(b) for b in batches] == [16, 16, 8]
    assert batches[0].images.is_cuda and batches[0].targets.is_cuda and not batches[0].labels.is_cuda
    check_coordinates(batches, samples, t)
    jpegs = jpeg_samples(20)
    (gpu,) = run_epochs(dali(EvalTransform(32, 36), options=opts), MemorySource("ds", jpegs), order="input")
    (cpu,) = run_epochs(dali(EvalTransform(32, 36)), MemorySource("ds", jpegs), order="input")
    assert float((gpu[0].images.cpu() - cpu[0].images).abs().mean()) * 0.226 * 255 < 3


@pytest.mark.slow
def test_decode_benchmark_prints_a_table():
    from dataferry.bench.decode import run_decode_bench

    out = run_decode_bench(images=4, runs=1, threads=2, passes=1, batch=4)
    for row in ("decode: Pillow", "decode: DALI cpu", "TorchIterator", "DaliIterator cpu", "images/s"):
        assert row in out


def test_default_options_decode_with_the_machines_thread_count():
    samples = jpeg_samples(20)
    (batches,) = run_epochs(dali(TrainTransform(size=24), options=DaliOptions(device="cpu")),
                            MemorySource("ds", samples), batch_size=8)
    assert sorted(i for b in batches for i in b.ids.tolist()) == sorted(s.id for s in samples)


def test_several_engine_processes_feed_dali_each_image_once_and_resume(tmp_path):
    """ProcessLoader(engines=2) from a real store into DALI (CPU): every image once an epoch,
    decoded, and DALI's state_dict resuming exactly with the other engine count."""
    import asyncio
    import datetime as dt

    from dataferry.client import PlanOptions, ProcessLoader
    from dataferry.schema import DatasetInfo, SampleMeta, SampleRecord, open_store

    samples = jpeg_samples(70)
    url = f"sqlite://{tmp_path}/s.db"

    async def fill():
        async with await open_store(url, create=True) as store:
            await store.put_samples("ds", [SampleRecord(s, SampleMeta(s.id, s.label, f"{s.id}.jpg", "jpeg", 8, 8,
                                                                        len(s.data), "0" * 64, {})) for s in samples])
            await store.put_dataset(DatasetInfo("ds", list("abcde"), len(samples),
                                                dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)))
            await store.put_split("ds", "all", IdList([s.id for s in samples], [s.label for s in samples]))

    asyncio.run(fill())
    opts, plan = DaliOptions(device="cpu", decode_depth=2), PlanOptions(seed=2)
    with ProcessLoader(url, "ds", batch_size=8, engines=2, plan=plan) as loader, \
            DaliIterator(loader, EvalTransform(16, 16), options=opts) as it:
        for epoch in range(2):
            batches = list(it)
            ids = [i for b in batches for i in b.ids.tolist()]
            assert sorted(ids) == [s.id for s in samples] and len(batches) == len(loader) == 10  # 35 + 35: 5 x 8 each
            assert all(b.images.shape[1:] == (3, 16, 16) and b.epoch == epoch for b in batches)
        third = iter(it)
        first = [next(third), next(third), next(third)]
        state = it.state_dict()
    taken = {i for b in first for i in b.ids.tolist()}
    with ProcessLoader(url, "ds", batch_size=8, engines=1, plan=plan) as loader, \
            DaliIterator(loader, EvalTransform(16, 16), options=opts) as it:
        it.load_state_dict(state)
        rest = [i for b in it for i in b.ids.tolist()]
    assert len(rest) == len(set(rest)) and not taken & set(rest) and taken | set(rest) == {s.id for s in samples}
