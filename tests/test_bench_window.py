"""bench/window.py (the window against latency) runs and its table adds up; no timing asserted."""

from __future__ import annotations

from dataferry.bench import window


def _rows(out: str) -> list[dict[str, str]]:
    """The printed table's rows, each a dict by column name."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def test_the_window_bench_prints_both_ratios_and_the_ramp_share(capsys):
    assert window.main(["--latencies", "0,20", "--images", "3000", "--size", "2000", "--seconds", "0.6",
                        "--runs", "1", "--batch-size", "64"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert [r["latency"] for r in rows] == ["0 ms", "20 ms"], out
    for r in rows:
        rate, steady = float(r["samples/s"].replace(",", "")), float(r["steady/s"].replace(",", ""))
        assert rate > 0 and steady > 0, r
        assert abs(float(r["ramp"]) - max(0.0, 1 - rate / steady)) < 0.011, r
        assert 0 < float(r["CPU share"]) <= 2.5, r  # two threads at most on CPU at once, and their CPU
        w, b = (float(x.split()[1]) for x in r["held"].split(", "))
        assert 0 <= w <= 1 and 0 <= b <= 1, r
    assert int(rows[1]["req ms"]) >= 20, rows[1]  # a request takes at least its emulated round trip
    assert rows[0]["ratio"] == rows[0]["steady ratio"] == "1.00", rows[0]
    assert "window over time" in out


def test_a_training_step_bounds_the_consumer_and_its_wait_is_printed(capsys):
    """--step-ms sleeps after each batch: the run cannot take more than batch / step samples/s, and
    the loop's wait for data is a share of the run (here the step, not the window, is the limit)."""
    assert window.main(["--latencies", "0,20", "--images", "3000", "--size", "2000", "--seconds", "0.6",
                        "--runs", "1", "--batch-size", "64", "--step-ms", "8"]) == 0
    out = capsys.readouterr().out
    assert "a training step of 8 ms a batch (at most 8,000 samples/s)" in out, out
    rows = _rows(out)
    for r in rows:
        # n batches take at least (n - 1) steps: about 75 in 0.6 s, so 1.4% over 8,000 at most
        assert float(r["samples/s"].replace(",", "")) <= 8000 * 1.03, r
        assert 0 <= float(r["loop waited"]) < 1, r
