"""bench/tune.py --http (a real server of 2 workers behind a latency proxy) runs and prints its
alternated pairs; no timing asserted."""

from __future__ import annotations

from dataferry.bench import tune


def test_the_http_tune_bench_prints_the_grid_and_alternated_pairs(capsys):
    assert tune.main(["--http", "--rtts", "0", "--pairs", "2", "--seconds", "0.3", "--store-images", "256",
                      "--batch-size", "32"]) == 0
    out = capsys.readouterr().out
    pairs = [line for line in out.splitlines() if line.startswith("|") and line.split("|")[1].strip() in ("1", "2")]
    assert len(pairs) == 2, out
    for line in pairs:
        cells = [c.strip() for c in line.strip("|").split("|")]
        default, best, ratio = (float(c.replace(",", "")) for c in cells[1:4])
        assert default > 0 and best > 0 and abs(ratio - default / best) < 0.011, line
    assert all(s in out for s in tune.HTTP_GRID), out
    assert "0 ms: default / best hand-tuned" in out and "over 2 alternated pairs" in out, out
