"""``python -m dataferry.bench.gpu_check``: the decoder agreement (PSNR) and ``--e2e``.

This machine has no GPU: ``--e2e`` must say so and exit 2, and with
``--allow-cpu`` run the whole command on DALI's CPU path (a real store, a real
``dataferry serve``, real latency-proxy processes). The PSNR threshold must
pass a right decoder, a decoder that differs as nvJPEG does (chroma
replicated instead of libjpeg-turbo's fancy upsampling), and fail wrong ones.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nvidia.dali")

from PIL import Image  # noqa: E402

from dataferry.bench import gpu_check  # noqa: E402
from dataferry.bench.decode import _jpegs  # noqa: E402
from dataferry.bench.gpu_check import MIN_PSNR, NO_GPU, agreement, dali_decode, pillow_decode  # noqa: E402
from dataferry.bench.gpu_e2e import HEADER  # noqa: E402
from dataferry.client._dali import dali_gpu_count  # noqa: E402

GPU = dali_gpu_count() > 0 and torch.cuda.is_available()


@pytest.fixture(scope="module")
def jpegs():
    blobs = _jpegs(gpu_check.AGREE_IMAGES)
    return blobs, pillow_decode(blobs)


def replicated_chroma(blob: bytes) -> np.ndarray:
    """A right decode that differs from libjpeg-turbo the way nvJPEG does: 4:2:0 chroma replicated over
    2x2 pixels instead of libjpeg-turbo's fancy (triangle) upsampling."""
    ycc = np.asarray(Image.open(io.BytesIO(blob)).convert("YCbCr")).astype(np.float64)
    h, w, _ = ycc.shape
    for c in (1, 2):
        pad = np.pad(ycc[..., c], ((0, h % 2), (0, w % 2)), mode="edge")
        box = pad.reshape(pad.shape[0] // 2, 2, pad.shape[1] // 2, 2).mean(axis=(1, 3))
        ycc[..., c] = np.repeat(np.repeat(box, 2, 0), 2, 1)[:h, :w]
    return np.asarray(Image.fromarray(np.clip(np.round(ycc), 0, 255).astype(np.uint8), "YCbCr").convert("RGB"))


def test_psnr_passes_right_decoders(jpegs):
    blobs, ref = jpegs
    dali = agreement(dali_decode(blobs, "cpu", None), ref)
    assert dali.ok and dali.min == float("inf") and dali.mean_abs_diff == 0  # both are libjpeg-turbo
    nvjpeg_like = agreement([replicated_chroma(b) for b in blobs], ref)
    assert nvjpeg_like.ok and 30 < nvjpeg_like.min < 45 and nvjpeg_like.mean_abs_diff > 1.5
    assert nvjpeg_like.min - MIN_PSNR >= 3  # a margin, not a coin toss


@pytest.mark.parametrize("wrong", ["R and B swapped", "one pixel right", "one pixel down", "another image", "grey",
                                   "YCbCr as RGB", "noise"])
def test_psnr_fails_wrong_decodes(jpegs, wrong):
    blobs, ref = jpegs
    got = dali_decode(blobs, "cpu", None)
    bad = {
        "R and B swapped": lambda: [g[..., ::-1] for g in got],
        "one pixel right": lambda: [np.roll(g, 1, axis=1) for g in got],
        "one pixel down": lambda: [np.roll(g, 1, axis=0) for g in got],
        "another image": lambda: [np.resize(got[(i + 1) % len(got)], g.shape) for i, g in enumerate(got)],
        "grey": lambda: [np.repeat(np.asarray(Image.fromarray(g).convert("L"))[..., None], 3, 2) for g in got],
        "YCbCr as RGB": lambda: [np.asarray(Image.fromarray(g).convert("YCbCr")) for g in got],
        "noise": lambda: [np.random.default_rng(i).integers(0, 256, g.shape, np.uint8) for i, g in enumerate(got)],
    }[wrong]()
    result = agreement(bad, ref)
    assert not result.ok
    assert max(result.psnrs) <= MIN_PSNR - 3, f"{wrong}: best image {max(result.psnrs):.1f} dB"


def test_psnr_fails_a_decode_of_the_wrong_size(jpegs):
    blobs, ref = jpegs
    got = dali_decode(blobs, "cpu", None)
    got[3] = got[3][:-1]
    result = agreement(got, ref)
    assert not result.ok and result.psnrs[3] == float("-inf") and result.min == float("-inf")
    assert "DISAGREES" in result.describe()


def test_a_wrong_decoder_fails_the_check(monkeypatch, capsys):
    real = gpu_check.dali_decode
    monkeypatch.setattr(gpu_check, "dali_decode", lambda *a: [g[..., ::-1] for g in real(*a)])
    args = ["--images", "8", "--batch", "8", "--passes", "1", "--runs", "1"]
    assert gpu_check.main(args + ([] if GPU else ["--allow-cpu"])) == 1
    out = capsys.readouterr().out
    assert re.search(r"decoder vs Pillow on 8 JPEGs: PSNR min \d+\.\d dB.*DISAGREES: below 27 dB", out)
    assert "images/s" in out  # the figures are still printed


@pytest.mark.skipif(GPU, reason="this machine has a GPU")
def test_e2e_without_a_gpu_exits_2_and_says_so(capsys):
    assert gpu_check.main(["--e2e"]) == NO_GPU
    err = capsys.readouterr().err
    assert "no usable GPU: the GPU path cannot run here (use --allow-cpu for the CPU path)" in err


def test_e2e_bad_arguments_are_named(capsys):
    for bad, what in ((["--rtts", "0,fast"], "--rtts"), (["--rtts", "-5"], "--rtts"), (["--epochs", "0"], "--epochs")):
        with pytest.raises(SystemExit) as info:
            gpu_check.main(["--e2e", "--allow-cpu", *bad])
        assert info.value.code == 2 and what in capsys.readouterr().err


def _table(out: str) -> list[list[str]]:
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith("|") and not line.startswith("|-")]
    assert rows[0] == HEADER
    return rows[1:]


def test_e2e_runs_to_the_end_with_every_column_for_every_rtt(tmp_path, capsys):
    args = ["--e2e", "--images", "64", "--epochs", "2", "--rtts", "0,20", "--out", str(tmp_path)]
    assert gpu_check.main(args + ([] if GPU else ["--allow-cpu"])) == 0
    out = capsys.readouterr().out
    assert re.search(r"decode ceiling from memory .*: [\d,]+ images/s", out)
    assert re.search(r"decoder vs Pillow on 16 JPEGs: PSNR min .* agrees", out)
    rows = _table(out)
    assert [r[:2] for r in rows] == [["0", "dali jpeg"], ["0", "torch jpeg"], ["20", "dali jpeg"], ["20", "torch jpeg"]]
    for r in rows:
        assert r[2] == "cpu (not GPU numbers)" if not GPU else r[2].startswith("gpu 0")
        numbers = [float(c.replace(",", "")) for c in r[3:]]  # every column filled: no "-"
        assert all(v > 0 for v in numbers), r
    # per-thread CPU is in clock ticks (10 ms): a 64-image row may not give the engine's thread one
    assert re.search(r"client CPU us/image by thread: \S+.* [\d,]+", out)
    doc = json.loads((tmp_path / "gpu_e2e.json").read_text())
    assert doc["command"].endswith(" ".join(args + ([] if GPU else ["--allow-cpu"])))
    assert doc["psnr"]["ok"] and doc["decode_ceiling_images_per_s"] > 0
    zero, zero_torch, twenty, twenty_torch = doc["rows"]
    for row in (zero, zero_torch, twenty, twenty_torch):
        assert row["epoch_images"] == [64, 64] and row["images"] == 128
        assert row["seconds_total"] > row["seconds_first_epoch"] >= row["first_batch_s"] > 0
        assert row["images_per_s_total"] == pytest.approx(128 / row["seconds_total"])
        assert row["steady_over_ceiling"] == pytest.approx(row["images_per_s_steady"] / row["ceiling"])
        assert row["client_cpu_s"] > 0 and row["server_cpu_s"] > 0  # the server's own process, from /proc
        assert 127.5 < row["images_served"] < 64 * 4 + 0.5  # the delivered ones and a look-ahead
    assert twenty["loader"]["min_latency"] >= 0.020  # the proxy is really in the path
    md = (tmp_path / "gpu_e2e.md").read_text()
    assert "| rtt ms |" in md and "steady / ceiling" in md and doc["command"] in md


def test_e2e_jpeg2000_rows_the_process_engine_and_the_profile(tmp_path, capsys):
    args = ["--e2e", "--images", "32", "--epochs", "2", "--rtts", "0", "--iterators", "dali",
            "--jpeg2000-images", "16", "--profile-rtt", "0", "--server-workers", "1", "--engines", "thread,process",
            "--out", str(tmp_path)]
    assert gpu_check.main(args + ([] if GPU else ["--allow-cpu"])) == 0
    out = capsys.readouterr().out
    assert re.search(r"16 of the JPEGs as lossless JPEG 2000 .*decode ceiling from memory: [\d,]+ images/s", out)
    assert [r[:2] for r in _table(out)] == [["0", "dali jpeg"], ["0", "dali jpeg [process]"],
                                            ["0", "dali jpeg2000"], ["0", "dali jpeg2000 [process]"]]
    rows = json.loads((tmp_path / "gpu_e2e.json").read_text())["rows"]
    assert [r["epoch_images"] for r in rows] == [[32, 32], [32, 32], [16, 16], [16, 16]]
    assert rows[2]["ceiling"] > 0
    # the engine process's CPU joins the client's: its spawn and imports alone cost more than the thread's row
    assert rows[1]["client_cpu_s"] > rows[0]["client_cpu_s"]
    profile = (tmp_path / "gpu_e2e_profile.txt").read_text()
    assert "## thread dataferry-engine" in profile and "## thread MainThread" in profile


def test_e2e_unknown_iterator_is_named(capsys):
    with pytest.raises(SystemExit) as info:
        gpu_check.main(["--e2e", "--allow-cpu", "--iterators", "dali,jax"])
    assert info.value.code == 2 and "--iterators" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        gpu_check.main(["--e2e", "--allow-cpu", "--engines", "thread,fork"])
    assert info.value.code == 2 and "--engines" in capsys.readouterr().err


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU visible to DALI and torch")
def test_mixed_decoder_agrees_with_pillow(jpegs):
    blobs, ref = jpegs
    result = agreement(dali_decode(blobs, "gpu", 0), ref)
    assert result.ok, result.describe()
