"""The example training script, end to end: synthetic JPEGs ingested into
SQLite, a real data service on loopback, the client, and a few SGD steps."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")

from dataferry.bench import train  # noqa: E402

pytestmark = pytest.mark.slow

ARGS = ["--synthetic", "40", "--steps", "12", "--batch-size", "8", "--size", "32", "--device", "cpu", "--workers", "2"]


def _run(capsys, loader: str, tmp_path) -> str:
    png = tmp_path / "train.png"
    assert train.main([*ARGS, "--loader", loader, "--interval", "0.2", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"interval(s) of 0.2 s: {png}" in out
    assert "data service on http://127.0.0.1:" in out
    m = re.search(r"12 steps \((\d+) epoch\(s\)\) on cpu with the (\w+) loader: ([\d,]+) images/s, "
                  r"data stall ([\d.]+)% \(loader network stall ([\d.]+)%\), loss ([\d.]+) -> ([\d.]+)", out)
    assert m, out
    epochs, kind, rate, stall, net, first, last = m.groups()
    assert kind == loader and int(epochs) == 3  # 40 samples, batches of 8 with drop_last: 5 steps per epoch
    assert float(rate.replace(",", "")) > 0 and 0 <= float(stall) <= 100 and 0 <= float(net) <= 100
    assert 0 < float(first) < 10 and 0 < float(last) < 10
    return out


def test_trains_with_the_torch_loader(capsys, tmp_path):
    _run(capsys, "torch", tmp_path)


def test_trains_with_dali_on_the_cpu(capsys, tmp_path):
    pytest.importorskip("nvidia.dali")
    _run(capsys, "dali", tmp_path)


def test_refuses_a_dataset_smaller_than_a_batch(capsys):
    with pytest.raises(SystemExit, match="gave no batch of 64"):
        train.main(["--synthetic", "10", "--steps", "2", "--batch-size", "64", "--loader", "torch", "--device", "cpu"])
