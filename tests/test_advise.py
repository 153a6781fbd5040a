"""``dataferry advise``: the storage advisor (schema/_ingest/, its CLI in schema/cli/_advise.py).

One measurement of a real folder of mixed formats (synthetic ImageNet-like
JPEGs plus PNG, WebP, BMP, TIFF and GIF photos, a corrupt file and a text
file) backs most tests: its JPEG q90 row is recomputed directly, and the
recommendation is checked against the numbers for a slow and a fast link.
The rules themselves are checked on measurements made up at our own seam.
"""

from __future__ import annotations

import asyncio
import io
import math
import re
import time
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from dataferry.client._decode_probe import dali_decode_rate
from dataferry.schema._ingest._advice import (
    DEFAULT_MIN_PSNR, Advice, AdviseOptions, Link, Measurement, Rules, Strategy, candidates,
)
from dataferry.schema._ingest._measure import choose_sample
from dataferry.schema._ingest._recommend import ingest_command, predict, recommend, render
from dataferry.schema.cli._advise import advise_source  # the advisor with this machine's decoders
from dataferry.schema.cli import main
from dataferry.schema._scan import scan
from dataferry.schema._synthetic import make_synthetic
from dataferry.schema._validate import ValidateOptions, validate_bytes

# (extension, PIL format, save options, mode) and how many of each besides the JPEGs
_OTHERS = [
    ("png", "PNG", {}, "RGB", 60), ("png", "PNG", {}, "L", 15), ("webp", "WEBP", {"lossless": True}, "RGB", 20),
    ("webp", "WEBP", {"quality": 85}, "RGB", 15), ("bmp", "BMP", {}, "RGB", 12),
    ("tif", "TIFF", {"compression": "tiff_lzw"}, "RGB", 12), ("gif", "GIF", {}, "P", 6),
]


def mixed_folder(root, jpegs: int = 61) -> int:
    """An ImageFolder of ``jpegs`` synthetic JPEGs, 140 photos in other formats
    (smaller: a long side of 160-320), a truncated PNG and a README; returns the image files."""
    make_synthetic(root, jpegs, classes=4, seed=3)
    photos = sorted(root.rglob("*.jpg"))
    rng = np.random.default_rng(7)
    i = 0
    for ext, fmt, params, mode, count in _OTHERS:
        for _ in range(count):
            with Image.open(photos[i % len(photos)]) as src:
                im = src.convert("RGB")
            scale = int(rng.integers(160, 321)) / max(im.size)
            im = im.resize((round(im.width * scale), round(im.height * scale)), Image.Resampling.BILINEAR)
            im = im.convert(mode) if mode != "P" else im.quantize(64)
            im.save(root / f"class_{i % 4:03d}" / f"other_{i:03d}.{ext}", fmt, **params)
            i += 1
    png = (root / "class_000" / "other_000.png").read_bytes()
    (root / "class_000" / "broken.png").write_bytes(png[: len(png) // 2])
    (root / "class_001" / "README.txt").write_text("not an image")
    return jpegs + i + 1


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("advise") / "mixed"
    files = mixed_folder(root)
    t0 = time.perf_counter()
    advice = advise_source(str(root), AdviseOptions(sample=200, seed=11, workers=2, dali="off", progress=False))
    print(f"\nadvise on {files} files, a sample of 200: {time.perf_counter() - t0:.1f} s")
    return root, files, advice


@pytest.mark.slow
def test_measures_every_candidate_on_a_reproducible_sample_of_mixed_formats(mixed):
    root, files, advice = mixed
    src = scan(str(root))
    assert len(src.files) == files == 202 and advice.num_images == 202  # README.txt skipped, broken.png counted
    picked = [src.files[i].relpath for i in choose_sample(202, 200, 11)]
    assert len(picked) == 200 and picked != [src.files[i].relpath for i in choose_sample(202, 200, 12)]
    assert advice.sample == tuple(p for p in picked if p != "class_000/broken.png")
    broken = "class_000/broken.png" in picked
    assert advice.rejected == ((("class_000/broken.png", "truncated image"),) if broken else ())
    fmt = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP", "bmp": "BMP", "tif": "TIFF", "gif": "GIF"}
    want = Counter(fmt[p.rsplit(".", 1)[1]] for p in advice.sample)
    assert dict(advice.formats) == dict(want)
    assert advice.kind == "mixed"
    assert [m.strategy.name for m in advice.rows] == [s.name for s in candidates("mixed")]
    for m in advice.rows:
        assert m.images == len(advice.sample) and m.mean_bytes > 0 and m.encode_s > 0
        assert math.isfinite(m.cpu_rate) and m.cpu_rate > 0 and m.gpu_rate is None
    assert advice.row("original").exact and advice.row("png").exact and advice.row("jpeg2000").exact
    assert not advice.row("jpeg q80").exact and advice.row("jpeg q80").psnr < advice.row("jpeg q95").psnr
    # a resized strategy changes the resolution (its own column) and is compared at the new size
    small = advice.row("jpeg q90 max 256")
    assert small.resized > 0 and small.long_out <= 256 < small.long_in and math.isfinite(small.psnr)
    assert advice.row("jpeg q90").full_resolution and advice.row("jpeg q90").long_out == small.long_in
    assert small.mean_bytes < advice.row("jpeg q90").mean_bytes


@pytest.mark.slow
def test_jpeg_q90_row_equals_a_direct_measurement_of_the_same_sample(mixed):
    root, _, advice = mixed
    sizes, sq_err, values = [], 0, 0
    for rel in advice.sample:
        data = (root / rel).read_bytes()
        stored = validate_bytes(rel, data, ValidateOptions(format="jpeg", quality=90)).data
        sizes.append(len(stored))
        with Image.open(io.BytesIO(data)) as im:
            want = np.asarray(im.convert("RGB"), np.int64)
        got = np.asarray(Image.open(io.BytesIO(stored)).convert("RGB"), np.int64)
        sq_err += int(((got - want) ** 2).sum())
        values += want.size
    row = advice.row("jpeg q90")
    assert row.mean_bytes == sum(sizes) / len(sizes)
    assert row.psnr == pytest.approx(10 * math.log10(255**2 * values / sq_err), abs=1e-9)


@pytest.mark.slow
def test_the_recommendation_follows_the_measured_numbers(mixed):
    _, _, advice = mixed
    rules = Rules()
    slow = recommend(advice, Link(bandwidth=1e3, rtt=0.1), rules)  # 8 kbit/s: every strategy link-bound
    eligible = [m for m in advice.rows if m.strategy.name in slow.eligible]
    assert {m.strategy.name for m in eligible} == {
        m.strategy.name for m in advice.rows if m.full_resolution and m.psnr >= DEFAULT_MIN_PSNR}
    assert slow.prediction.bound == "link"
    assert slow.row.mean_bytes == min(m.mean_bytes for m in eligible)
    fast = recommend(advice, Link(bandwidth=1e15, rtt=0), rules)  # every strategy decode-bound
    assert fast.prediction.bound == "decode"
    assert fast.row.decode_rate * 1.01 >= max(m.decode_rate for m in eligible)
    # what the table prints for the recommended row is its prediction, and no eligible row predicts less
    text = render(advice, Link(1e3, 0.1), rules, slow)
    line = next(x for x in text.splitlines() if x.endswith("<- recommended"))
    assert line.startswith(slow.row.strategy.name + " ") and " link " in line
    assert all(predict(m, advice.num_images, Link(1e3, 0.1)).epoch_s >= slow.prediction.epoch_s for m in eligible)
    # resizing only where --max-side permits it
    assert recommend(advice, Link(1e3, 0.1), Rules(min_psnr=20, max_side=256)).row.strategy.name == "jpeg q90 max 256"
    assert recommend(advice, Link(1e3, 0.1), Rules(min_psnr=20)).row.full_resolution


# --- the rules, on measurements made up at our seam ---------------------------------------


def row(name: str, *, kb: float, rate: float, psnr: float = math.inf, fmt: str | None = "jpeg",
        side: int | None = None, resized: int = 0) -> Measurement:
    return Measurement(Strategy(name, fmt, 90, side), 100, kb * 1e3, 0.01, 1 / rate, rate, None, psnr,
                       psnr == math.inf, resized, 500.0, 500.0 if not resized else float(side))


def made_up(kind: str, *rows: Measurement) -> Advice:
    return Advice("test", 100_000, ("a",), (), (("PNG", 1),), kind, 4, None, 0, rows)


ROWS = (
    row("original", kb=500, rate=400, fmt=None),
    row("png", kb=450, rate=300, fmt="png"),
    row("jpeg2000", kb=300, rate=30, fmt="jpeg2000"),
    row("jpeg q95", kb=150, rate=900, psnr=44.0),
    row("jpeg q80", kb=60, rate=1200, psnr=36.0),
    row("jpeg q90 max 256", kb=20, rate=5000, psnr=40.0, side=256, resized=90),
)


def test_lossless_source_gets_an_exact_strategy_unless_min_psnr_is_given():
    advice = made_up("lossless", *ROWS)
    slow, fast = Link(1e6, 0.1), Link(1e12, 0.1)
    assert recommend(advice, slow).row.strategy.name == "jpeg2000"  # fewest exact bytes
    assert recommend(advice, fast).row.strategy.name == "original"  # fastest exact decode
    assert recommend(advice, slow).eligible == ("original", "png", "jpeg2000")
    assert recommend(advice, slow, Rules(min_psnr=40)).row.strategy.name == "jpeg q95"
    assert recommend(advice, slow, Rules(min_psnr=30)).row.strategy.name == "jpeg q80"
    assert recommend(advice, slow, Rules(min_psnr=30, max_side=256)).row.strategy.name == "jpeg q90 max 256"
    assert recommend(advice, slow, Rules(min_psnr=30, max_side=384)).row.strategy.name == "jpeg q80"


def test_lossy_source_keeps_the_default_psnr_floor_and_full_resolution():
    advice = made_up("lossy", *ROWS)
    rec = recommend(advice, Link(1e6, 0.1))
    assert rec.row.strategy.name == "jpeg q95" and rec.prediction.bound == "link"
    assert "jpeg q80" not in rec.eligible and "jpeg q90 max 256" not in rec.eligible
    assert "PSNR >= 38 dB, full resolution" in rec.reason and "original bytes would take" in rec.reason
    fast = recommend(advice, Link(1e12, 0))
    assert fast.row.strategy.name == "jpeg q95" and fast.prediction.bound == "decode"  # 900 img/s, the fastest


def test_a_tie_within_one_percent_goes_to_fewer_bytes():
    advice = made_up("lossy", row("original", kb=100, rate=1000, fmt=None), row("jpeg q95", kb=90, rate=995, psnr=45))
    rec = recommend(advice, Link(1e12, 0))  # both decode-bound, 0.5% apart
    assert rec.row.strategy.name == "jpeg q95"
    advice = made_up("lossy", row("original", kb=100, rate=1000, fmt=None), row("jpeg q95", kb=90, rate=900, psnr=45))
    assert recommend(advice, Link(1e12, 0)).row.strategy.name == "original"


def test_prediction_is_the_larger_bound_plus_setup():
    m = row("x", kb=100, rate=1000)
    p = predict(m, 10_000, Link(bandwidth=125e6, rtt=0.1))  # 1 GB over 1 Gbit/s: 8 s; 10 s of decode
    assert (p.link_s, p.decode_s, p.setup_s, p.bound) == (pytest.approx(8.0), pytest.approx(10.0), pytest.approx(0.4),
                                                          "decode")
    assert p.epoch_s == pytest.approx(10.4)
    assert predict(m, 10_000, Link(bandwidth=12.5e6, rtt=0)).bound == "link"


def test_ingest_command_applies_the_strategy():
    advice = made_up("lossless", *ROWS)
    rec = recommend(advice, Link(1e6, 0.1))
    assert ingest_command(rec, src="/data/my set", dataset="seg", store="sqlite:x.db") == (
        "dataferry ingest '/data/my set' --dataset seg --store sqlite:x.db --format jpeg2000")
    rec = recommend(advice, Link(1e6, 0.1), Rules(min_psnr=30, max_side=256))
    assert ingest_command(rec, src=None, dataset="seg", store="sqlite:x.db") == (
        "dataferry ingest SRC --dataset seg-jpeg-q90-max-256 --store sqlite:x.db --format jpeg --quality 90 "
        "--max-side 256")


def test_choose_sample_is_seeded_and_covers_small_sources():
    assert choose_sample(1000, 5, 1) == choose_sample(1000, 5, 1) != choose_sample(1000, 5, 2)
    assert len(set(choose_sample(1000, 200, 0))) == 200 and choose_sample(7, 200, 0) == list(range(7))


def test_options_refuse_bad_values():
    from dataferry.schema import ConfigError

    for bad in (lambda: Link(0, 0.1), lambda: Link(1e6, -1), lambda: Rules(min_psnr=-3), lambda: Rules(max_side=0),
                lambda: AdviseOptions(sample=0), lambda: AdviseOptions(qualities=(101,))):
        with pytest.raises(ConfigError):
            bad()


# --- the command line -------------------------------------------------------------------------


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """12 images: 8 JPEGs and 4 PNGs."""
    root = tmp_path_factory.mktemp("advise-small") / "pets"
    make_synthetic(root, 8, classes=2, seed=5)
    for i, jpg in enumerate(sorted(root.rglob("*.jpg"))[:4]):
        with Image.open(jpg) as im:
            im.convert("RGB").resize((200, 150)).save(jpg.with_name(f"p{i}.png"))
    return root


def test_cli_prints_the_table_the_recommendation_and_the_ingest_command(small, tmp_path, capsys):
    chart = tmp_path / "advice.png"
    code, out, err = cli(capsys, "advise", small, "--sample", 12, "--workers", 1, "--link", "100mbit", "--rtt", "50ms",
                         "--max-side", 300, "--plot", chart, "--quiet", "--store", "sqlite:pets.db")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"advise {small}: 12 images; measured 12 sampled (seed 0): JPEG 8, PNG 4; a mixed source")
    assert "link 100 Mbit/s, RTT 50 ms" in out and "no GPU" in out
    names = [s.name for s in candidates("mixed", sides=(512, 384, 300, 256))]
    table = lines[2 : 3 + len(names)]
    assert table[0].split()[:2] == ["STRATEGY", "KB/IMG"] and [r.split("  ")[0] for r in table[1:]] == names
    assert sum(r.endswith("<- recommended") for r in table) == 1
    assert any(line.startswith("recommended: ") for line in lines)
    assert lines[-2].startswith(f"dataferry ingest {small} --dataset pets --store sqlite:pets.db")
    assert lines[-1] == f"plot: {chart}" and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_advises_on_a_stored_dataset(small, tmp_path, capsys):
    url = f"sqlite:{tmp_path / 'store.db'}"
    assert cli(capsys, "ingest", small, "--dataset", "pets", "--store", url, "--workers", 1, "--quiet")[0] == 0
    code, out, err = cli(capsys, "advise", "--dataset", "pets", "--store", url, "--workers", 1, "--quiet",
                         "--link", "10mbit")
    assert code == 0, err
    assert out.startswith(f"advise dataset 'pets' in {url}: 12 images; measured 12 sampled")
    assert "dataferry ingest SRC --dataset pets-" in out or "keep dataset 'pets' as it is stored" in out


def test_cli_errors_name_the_thing_at_fault(tmp_path, capsys):
    code, _, err = cli(capsys, "advise", tmp_path / "missing")
    assert code == 2 and err == f"dataferry: error: source '{tmp_path / 'missing'}' does not exist\n"
    (tmp_path / "empty" / "cats").mkdir(parents=True)
    code, _, err = cli(capsys, "advise", tmp_path / "empty")
    assert code == 2 and err.count("\n") == 1 and f"no images in '{tmp_path / 'empty'}'" in err
    url = f"sqlite:{tmp_path / 'store.db'}"
    from dataferry.schema import open_store

    async def make():
        await (await open_store(url)).close()

    asyncio.run(make())
    code, _, err = cli(capsys, "advise", "--dataset", "nope", "--store", url)
    assert code == 2 and err.startswith("dataferry: error: unknown dataset 'nope' in sqlite store") and err.count("\n") == 1
    code, _, err = cli(capsys, "advise")
    assert code == 2 and "advise needs a source" in err
    code, _, err = cli(capsys, "advise", tmp_path / "empty", "--link", "1mbps")
    assert code == 2 and "bad rate '1mbps'" in err


def test_dali_decode_rate_runs_the_pipeline_it_would_run_on_a_gpu():
    pytest.importorskip("nvidia.dali")
    rng = np.random.default_rng(0)
    im = Image.fromarray(rng.integers(0, 256, (64, 80, 3), dtype=np.uint8))
    blobs = []
    for fmt in ("jpeg", "png", "jpeg2000"):
        blobs.append(validate_bytes("x", _png(im), ValidateOptions(format=fmt)).data)
    rate = dali_decode_rate(blobs * 3, device="cpu", batch=4, rounds=2)
    assert math.isfinite(rate) and rate > 0


def test_the_dali_column_runs_the_decode_pipeline_and_says_which_bytes_it_cannot_decode(small, tmp_path):
    pytest.importorskip("nvidia.dali")
    folder = tmp_path / "withgif"
    for path in sorted(small.rglob("*.*"))[:6]:
        (folder / path.parent.name).mkdir(parents=True, exist_ok=True)
        (folder / path.parent.name / path.name).write_bytes(path.read_bytes())
    with Image.open(next(small.rglob("*.png"))) as im:
        im.convert("RGB").quantize(32).save(folder / path.parent.name / "anim.gif")
    advice = advise_source(str(folder), AdviseOptions(sample=7, workers=1, dali="cpu", sides=(256,), qualities=(90,),
                                                      progress=False))
    assert advice.dali == "DALI's CPU decoder" and dict(advice.formats)["GIF"] == 1
    original = advice.row("original")  # the GIF's own bytes: DALI has no GIF decoder
    assert original.gpu_rate is None and original.gpu_error and original.decode_rate == original.cpu_rate
    for m in advice.rows[1:]:  # re-encoded: PNG, JPEG 2000, JPEG
        assert m.gpu_error is None and math.isfinite(m.gpu_rate) and m.gpu_rate > 0 and m.decode_rate == m.gpu_rate
    text = render(advice, Link(), Rules(), recommend(advice, Link()))
    assert "DALI: DALI's CPU decoder" in text and re.search(r"^original .* fails ", text, re.M)
    assert f"DALI fails on original's bytes: {original.gpu_error}" in text


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def test_render_marks_bounds_and_says_no_gpu():
    advice = made_up("lossy", *ROWS)
    rec = recommend(advice, Link(1e9, 0.1))
    text = render(advice, Link(1e9, 0.1), Rules(), rec)
    rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in text.splitlines()[3:9])}
    assert list(rows) == [m.strategy.name for m in ROWS]
    for m in ROWS:
        cells = rows[m.strategy.name]
        assert cells[4] == "no GPU" and cells[8] == predict(m, 100_000, Link(1e9, 0.1)).bound
        assert cells[5] == ("exact" if m.exact else f"{m.psnr:.1f} dB")
    assert rows["jpeg q90 max 256"][9] == "resized" and rows["jpeg q80"][9] == "PSNR < 38 dB"
    assert len(rows["png"]) == 9  # eligible, not chosen: no note
    assert [name for name, cells in rows.items() if cells[-1] == "<- recommended"] == [rec.row.strategy.name]
