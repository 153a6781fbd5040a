"""Ingest: scanning, validation and the write flow, on every store backend."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import shutil
import unicodedata
import warnings

import numpy as np
import pytest
from oddfiles import build_odd_tree, noise_image
from PIL import Image

from dataferry.schema import ALL_SPLIT, ConfigError, IntegrityError, InvalidImage, StoreError, open_store, sample_id
from dataferry.schema._ingest import IngestOptions, ingest
from dataferry.schema._scan import scan
from dataferry.schema._validate import ValidateOptions, validate_chunk, validate_file

FAST = IngestOptions(workers=2, batch_size=4, max_inflight=2)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    return build_odd_tree(tmp_path_factory.mktemp("odd") / "tree")


class Spy:
    """A store wrapper that counts write calls and in-flight put_samples."""

    def __init__(self, store, fail_after: int | None = None):
        self._store = store
        self.writes: list[str] = []
        self.batch_sizes: list[int] = []
        self.inflight = self.max_inflight = 0
        self._fail_after = fail_after

    def __getattr__(self, name):
        return getattr(self._store, name)

    async def put_samples(self, dataset, records):
        if self._fail_after is not None and len(self.batch_sizes) >= self._fail_after:
            raise StoreError("injected write failure")
        self.writes.append("put_samples")
        self.batch_sizes.append(len(records))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            await asyncio.sleep(0.01)
            await self._store.put_samples(dataset, records)
        finally:
            self.inflight -= 1

    async def put_split(self, *a):
        self.writes.append("put_split")
        await self._store.put_split(*a)

    async def put_dataset(self, *a):
        self.writes.append("put_dataset")
        await self._store.put_dataset(*a)


async def _ingest(url, src, dataset, options=FAST, fail_after=None):
    async with await open_store(url) as store:
        spy = Spy(store, fail_after)
        report = await ingest(spy, src, dataset, options, progress=False)
        return report, spy


# --- scan ---------------------------------------------------------------------


def test_scan_finds_images_skips_junk_and_numbers_classes(odd):
    src = scan(odd.root)
    assert src.label_names == ("bird", "cat", "dog")
    assert [f.relpath for f in src.files] == sorted([*odd.valid, *odd.bad])
    assert src.skipped == tuple(sorted(odd.junk))
    for f in src.files:
        assert f.label == src.label_names.index(f.relpath.split("/")[0])
        assert f.relpath == unicodedata.normalize("NFC", f.relpath)
    assert "dog/café nfd.png" in {f.relpath for f in src.files}  # written with an NFD name


def test_scan_class_order_is_codepoint_order(tmp_path):
    for name in ("b", "B", "é", "a", "Z", "10", "9"):
        (tmp_path / name).mkdir()
        noise_image(8, 8).save(tmp_path / name / "x.png")
    (tmp_path / ".git").mkdir()
    assert scan(tmp_path).label_names == ("10", "9", "B", "Z", "a", "b", "é")


def test_scan_errors_name_the_source(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        scan(tmp_path / "missing")
    (tmp_path / "loose.jpg").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a manifest"):
        scan(tmp_path / "loose.jpg")
    with pytest.raises(ConfigError, match="no class folders"):
        scan(tmp_path)


def _manifest_tree(tmp_path):
    (tmp_path / "img").mkdir()
    for k in range(4):
        noise_image(16, 12, seed=k).save(tmp_path / "img" / f"{k}.png")
        (tmp_path / "img" / f"{k}.mask").write_bytes(bytes([k]) * 10)
    other = tmp_path / "elsewhere"
    other.mkdir()
    noise_image(10, 10, seed=9).save(other / "abs.jpg")
    return other / "abs.jpg"


def test_scan_manifest_csv_and_jsonl_agree(tmp_path):
    absolute = _manifest_tree(tmp_path)
    csv_text = "path,label,target,split_hint,note\n"
    csv_text += "".join(f"img/{k}.png,{'dog' if k % 2 else 'cat'},img/{k}.mask,h{k},\n" for k in range(4))
    csv_text += f"{absolute},zebra,,,far away\nimg/readme.txt,cat,,,\n"
    (tmp_path / "m.csv").write_text(csv_text)
    rows = [{"path": f"img/{k}.png", "label": "dog" if k % 2 else "cat", "target": f"img/{k}.mask", "split_hint": f"h{k}"}
            for k in range(4)]
    rows += [{"path": str(absolute), "label": "zebra", "note": "far away"}, {"path": "img/readme.txt", "label": "cat"}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = scan(tmp_path / "m.csv"), scan(tmp_path / "m.jsonl")
    assert a.files == b.files and a.label_names == b.label_names == ("cat", "dog", "zebra")
    assert a.skipped == ("img/readme.txt",)
    by = {f.relpath: f for f in a.files}
    assert set(by) == {"img/0.png", "img/1.png", "img/2.png", "img/3.png", "elsewhere/abs.jpg"}
    assert by["img/1.png"].label == 1 and by["img/1.png"].tags == {"split_hint": "h1"}
    assert by["img/1.png"].target == str(tmp_path / "img" / "1.mask")
    assert by["elsewhere/abs.jpg"].tags == {"note": "far away"} and by["elsewhere/abs.jpg"].target is None


def test_scan_manifest_rejects_bad_rows(tmp_path):
    (tmp_path / "a.csv").write_text("path,label\nx.png,cat\nx.png,dog\n")
    with pytest.raises(ConfigError, match=r"a.csv:3: path 'x.png' is listed twice"):
        scan(tmp_path / "a.csv")
    (tmp_path / "b.csv").write_text("path\nx.png\n")
    with pytest.raises(ConfigError, match="no 'label'"):
        scan(tmp_path / "b.csv")
    (tmp_path / "c.jsonl").write_text('{"path": "x.png", "label": "a"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"c.jsonl:2: not valid JSON"):
        scan(tmp_path / "c.jsonl")


# --- validate -------------------------------------------------------------------


def test_every_bad_file_gets_its_reason(odd):
    for rel, reason in odd.bad.items():
        with pytest.raises(InvalidImage) as exc:
            validate_file(str(odd.path(rel)))
        assert reason in exc.value.reason, (rel, exc.value.reason)
        assert exc.value.path == str(odd.path(rel))


def test_every_odd_image_validates_and_keeps_its_bytes(odd):
    for rel in odd.valid:
        path = odd.path(rel)
        vf = validate_file(str(path))
        assert vf.data == path.read_bytes()
        assert vf.sha256 == hashlib.sha256(vf.data).hexdigest()
        assert vf.bytes_in == vf.bytes_out == path.stat().st_size


def test_bomb_between_the_warning_and_the_error_limit_is_rejected(tmp_path):
    """Pillow only *warns* up to twice its limit; that must reject too."""
    path = tmp_path / "big.png"
    noise_image(100, 100).save(path)
    before = Image.MAX_IMAGE_PIXELS
    with pytest.raises(InvalidImage, match=r"decompression bomb: 10000 pixels > limit 6000"):
        validate_file(str(path), ValidateOptions(max_pixels=6000))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # even when the caller ignores warnings
        with pytest.raises(InvalidImage, match="decompression bomb"):
            validate_file(str(path), ValidateOptions(max_pixels=9000))
    assert Image.MAX_IMAGE_PIXELS == before
    assert validate_file(str(path), ValidateOptions(max_pixels=10_000)).width == 100


def test_reencode_converts_odd_modes_and_applies_exif(odd):
    opts = ValidateOptions(format="jpeg", quality=80, max_side=32)
    for rel in odd.valid:
        vf = validate_file(str(odd.path(rel)), opts)
        with Image.open(io.BytesIO(vf.data)) as im:
            assert im.format == vf.format == "JPEG" and im.mode in ("RGB", "L"), rel
            assert im.size == (vf.width, vf.height) and max(im.size) <= 32, rel
    rotated = validate_file(str(odd.path("dog/exif rotated.jpg")), ValidateOptions(format="png"))
    assert (rotated.width, rotated.height) == (30, 60)  # stored 60x30 with orientation 6
    gray16 = validate_file(str(odd.path("cat/gray16.png")), ValidateOptions(format="jpeg"))
    with Image.open(io.BytesIO(gray16.data)) as im:
        assert im.mode == "L" and im.getextrema()[1] > 200  # scaled from 16 bits, not clipped to white
    cmyk = validate_file(str(odd.path("cat/cmyk.jpg")), ValidateOptions(format="png"))
    assert cmyk.format == "PNG" and Image.open(io.BytesIO(cmyk.data)).mode == "RGB"


def test_max_side_keeps_aspect(tmp_path):
    noise_image(400, 100).save(tmp_path / "wide.png")
    vf = validate_file(str(tmp_path / "wide.png"), ValidateOptions(format="png", max_side=100))
    assert (vf.width, vf.height) == (100, 25)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"format": "gif"}, "unknown image format"), ({"quality": 0}, "quality"), ({"max_side": 64}, "needs a format"),
     ({"max_pixels": 0}, "max_pixels")],
)
def test_validate_options_are_checked(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ValidateOptions(**kwargs)


def test_validate_chunk_reports_missing_files_and_targets(tmp_path):
    noise_image(8, 8).save(tmp_path / "ok.png")
    out = validate_chunk([(str(tmp_path / "nope.png"), None), (str(tmp_path / "ok.png"), str(tmp_path / "m"))],
                         ValidateOptions())
    assert [o.reason for o in out] == ["file not found", f"target file not found: {tmp_path / 'm'}"]


# --- ingest ------------------------------------------------------------------------


def test_ingest_odd_tree(store_url, dataset_name, odd):
    report, spy = run(_ingest(store_url, odd.root, dataset_name))
    assert report.ingested == len(odd.valid) and report.already_present == 0
    assert dict(report.rejected).keys() == odd.bad.keys()
    for rel, reason in report.rejected:
        assert odd.bad[rel] in reason
    assert report.skipped == tuple(sorted(odd.junk)) and not report.ok
    assert report.bytes_in == report.bytes_out == sum(odd.path(r).stat().st_size for r in odd.valid)
    assert max(spy.batch_sizes) <= FAST.batch_size and spy.max_inflight <= FAST.max_inflight

    async def check():
        async with await open_store(store_url) as store:
            info = await store.get_dataset(dataset_name)
            assert info.label_names == ("bird", "cat", "dog") and info.num_samples == len(odd.valid)
            bad_ids = [sample_id(dataset_name, rel) for rel in odd.bad]
            assert await store.existing(dataset_name, bad_ids) == set()
            got = {r.id: r async for r in store.fetch(dataset_name, bad_ids)}
            assert all(isinstance(r, Exception) for r in got.values())
            ids = {sample_id(dataset_name, rel): rel for rel in odd.valid}
            split = await store.read_split(dataset_name, ALL_SPLIT)
            assert split.ids.tolist() == sorted(ids)
            metas = await store.read_meta(dataset_name, list(ids))
            async for s in store.fetch(dataset_name, list(ids)):
                rel = ids[s.id]
                assert s.data == (odd.path(rel)).read_bytes(), rel  # byte-exact
                assert s.label == info.label_names.index(odd.valid[rel]) == metas[s.id].label
                assert metas[s.id].path == rel and metas[s.id].checksum == hashlib.sha256(s.data).hexdigest()
            assert dict(zip(split.ids.tolist(), split.labels.tolist())) == {i: metas[i].label for i in ids}

    run(check())
    again, spy = run(_ingest(store_url, odd.root, dataset_name))
    assert (again.ingested, again.already_present, len(again.rejected)) == (0, len(odd.valid), len(odd.bad))
    assert spy.writes == []  # a re-run writes nothing at all


def test_ingest_adds_new_files_and_keeps_labels_stable(store_url, dataset_name, tmp_path):
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        noise_image(10, 10, seed=ord(cls)).save(tmp_path / cls / "1.png")
    first, _ = run(_ingest(store_url, tmp_path, dataset_name))
    noise_image(10, 10, seed=5).save(tmp_path / "b" / "2.png")
    second, spy = run(_ingest(store_url, tmp_path, dataset_name))
    assert (first.ingested, second.ingested, second.already_present, second.num_samples) == (2, 1, 2, 3)
    assert spy.writes.count("put_samples") == 1
    (tmp_path / "c").mkdir()
    noise_image(10, 10).save(tmp_path / "c" / "1.png")
    with pytest.raises(IntegrityError, match=r"has labels \['a', 'b'\] but .* has \['a', 'b', 'c'\]"):
        run(_ingest(store_url, tmp_path, dataset_name))


def test_interrupted_ingest_is_finished_by_a_rerun(store_url, dataset_name, tmp_path):
    shutil.copytree(_synthetic_tree(tmp_path / "src", 40), tmp_path / "tree")
    with pytest.raises(StoreError, match="injected"):
        run(_ingest(store_url, tmp_path / "tree", dataset_name, IngestOptions(workers=2, batch_size=4, max_inflight=1),
                    fail_after=3))

    async def committed():
        async with await open_store(store_url) as store:
            ids = [sample_id(dataset_name, f.relpath) for f in scan(tmp_path / "tree").files]
            return len(await store.existing(dataset_name, ids))

    partial = run(committed())
    assert 0 < partial < 40
    report, _ = run(_ingest(store_url, tmp_path / "tree", dataset_name))
    assert (report.already_present, report.ingested, report.num_samples) == (partial, 40 - partial, 40)
    assert run(committed()) == 40


def _synthetic_tree(root, n):
    from dataferry.schema._synthetic import make_synthetic

    make_synthetic(root, n, classes=3, target_kb=5)
    return root


def test_id_collisions_are_integrity_errors(store_url, dataset_name, tmp_path, monkeypatch):
    for name in ("x", "y"):
        (tmp_path / "c").mkdir(exist_ok=True)
        noise_image(8, 8).save(tmp_path / "c" / f"{name}.png")
    import dataferry.schema._ingest._ingest as mod

    monkeypatch.setattr(mod, "sample_id", lambda dataset, rel: 42)
    with pytest.raises(IntegrityError, match=r"'c/x.png' and 'c/y.png' both hash to id 42"):
        run(_ingest(store_url, tmp_path, dataset_name))
    (tmp_path / "c" / "y.png").unlink()
    run(_ingest(store_url, tmp_path, dataset_name))
    (tmp_path / "c" / "x.png").rename(tmp_path / "c" / "z.png")
    with pytest.raises(IntegrityError, match=r"'c/z.png' has sample id 42, already taken by 'c/x.png'"):
        run(_ingest(store_url, tmp_path, dataset_name))


def test_ingest_manifest_stores_targets_and_tags(store_url, dataset_name, tmp_path):
    _manifest_tree(tmp_path)
    (tmp_path / "m.csv").write_text(
        "path,label,target,source\n" + "".join(f"img/{k}.png,c{k % 2},img/{k}.mask,cam{k}\n" for k in range(4))
    )
    report, _ = run(_ingest(store_url, tmp_path / "m.csv", dataset_name))
    assert report.ingested == 4

    async def check():
        async with await open_store(store_url) as store:
            ids = {sample_id(dataset_name, f"img/{k}.png"): k for k in range(4)}
            metas = await store.read_meta(dataset_name, list(ids))
            async for s in store.fetch(dataset_name, list(ids)):
                k = ids[s.id]
                assert s.target == bytes([k]) * 10 and s.label == k % 2
                assert dict(metas[s.id].tags) == {"source": f"cam{k}"}

    run(check())


def test_ingest_reencoded(store_url, dataset_name, odd):
    report, _ = run(_ingest(store_url, odd.root, dataset_name, IngestOptions(workers=1, format="jpeg", max_side=24)))
    assert report.ingested == len(odd.valid)

    async def check():
        async with await open_store(store_url) as store:
            ids = [sample_id(dataset_name, rel) for rel in odd.valid]
            metas = await store.read_meta(dataset_name, ids)
            async for s in store.fetch(dataset_name, ids):
                m = metas[s.id]
                with Image.open(io.BytesIO(s.data)) as im:
                    assert im.format == m.format == "JPEG" and im.size == (m.width, m.height)
                assert max(m.width, m.height) <= 24 and m.size == len(s.data)

    run(check())


def test_ingest_options_are_validated():
    with pytest.raises(ConfigError, match="workers"):
        IngestOptions(workers=0)
    with pytest.raises(ConfigError, match="batch_size"):
        IngestOptions(batch_size=0)
    with pytest.raises(ConfigError, match="needs a format"):
        IngestOptions(max_side=10)
    with pytest.raises(ConfigError, match="invalid dataset name"):
        run(ingest(None, ".", "bad name", progress=False))


def test_report_rates():
    from dataferry.schema._ingest import IngestReport

    r = IngestReport("d", "/src", 100, 0, (), (), 50_000_000, 50_000_000, 2.0, 100)
    assert (r.images_per_s, r.mb_per_s, r.ok) == (50.0, 25.0, True)
    assert "50 images/s, 25.0 MB/s" in r.summary()
    assert np.isclose(IngestReport("d", "/s", 0, 0, (("a", "b"),), (), 0, 0, 0.0, 0).images_per_s, 0.0)


def test_a_name_that_is_not_utf8_is_rejected_not_fatal(store_url, dataset_name, tmp_path):
    root = tmp_path / "tree"
    (root / "c").mkdir(parents=True)
    noise_image(8, 8).save(root / "c" / "ok.png")
    bad = os.path.join(os.fsencode(root / "c"), b"caf\xe9.png")
    with open(bad, "wb") as fh:
        fh.write((root / "c" / "ok.png").read_bytes())
    with open(os.path.join(os.fsencode(root), b"notes\xff.txt"), "wb") as fh:
        fh.write(b"junk")
    report, _ = run(_ingest(store_url, root, dataset_name))
    assert report.ingested == 1 and report.rejected == (("c/caf\ufffd.png", "file name is not valid UTF-8"),)
    assert report.skipped == ("notes\ufffd.txt",)


def test_memory_stays_bounded(tmp_path):
    """Ingesting ~22 MB of images never holds more than a few batches in this process."""
    import tracemalloc

    from dataferry.schema._synthetic import make_synthetic

    syn = make_synthetic(tmp_path / "src", 200, seed=1)
    assert syn.total_bytes > 18e6
    options = IngestOptions(workers=2, batch_size=8, max_inflight=2)
    tracemalloc.start()
    try:
        report, _ = run(_ingest(f"sqlite:{tmp_path / 'm.db'}", tmp_path / "src", "mem", options))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.ingested == 200
    assert peak < syn.total_bytes / 3, (peak, syn.total_bytes)
