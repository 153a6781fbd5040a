"""bench/tune.py --http (a real server of 2 workers behind a latency proxy) runs and prints its
alternated pairs; no timing asserted."""

from __future__ import annotations

from dataferry.bench import tune


def _pairs(text: str) -> list[tuple[float, float, float]]:
    """The numbered rows of a pairs table: (first /s, second /s, ratio)."""
    rows = [line for line in text.splitlines() if line.startswith("|") and line.split("|")[1].strip().isdigit()]
    return [tuple(float(c.strip().replace(",", "")) for c in line.strip("|").split("|")[1:4]) for line in rows]


def test_the_http_tune_bench_prints_the_grid_alternated_pairs_and_the_control(capsys):
    assert tune.main(["--http", "--rtts", "0", "--pairs", "2", "--seconds", "0.3", "--store-images", "256",
                      "--batch-size", "32", "--control"]) == 0
    out = capsys.readouterr().out
    default_pairs, _, control = out.partition("\ncontrol, ")
    for rows in (_pairs(default_pairs), _pairs(control)):
        assert len(rows) == 2, out
        for first, second, ratio in rows:
            assert first > 0 and second > 0 and abs(ratio - first / second) < 0.011, out
    assert all(s in out for s in tune.HTTP_GRID), out
    assert "0 ms: default / best hand-tuned" in out and "over 2 alternated pairs, within 10% in" in out, out
    assert "0 ms: control, the best against itself" in out and "over 2 pairs, within 10% in" in out, out


def test_within_counts_the_pairs_that_read_at_least_nine_tenths():
    assert tune._within([0.85, 0.90, 1.20, 0.899]) == "within 10% in 2 of 4"
