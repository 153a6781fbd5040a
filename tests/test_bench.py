"""``dataferry bench``: the sweep machinery end to end on a tiny dataset, the
report from a made-up summary, the options, and the namespace links as root."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shutil

import pytest

from dataferry.bench import cli as bench_cli
from dataferry.bench._links import NETEM_SCRIPTS, Condition, NamespaceLink, ProxyLink
from dataferry.bench.report import render_markdown, write_plots
from dataferry.bench.sweep import LOADERS, SweepOptions
from dataferry.schema import ConfigError

has_wds = importlib.util.find_spec("webdataset") is not None
has_torch = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not has_torch, reason="the naive and WebDataset loaders need torch")
is_root = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None

PNGS = ("throughput.png", "first_batch.png", "cpu.png")


def bench(*argv) -> int:
    return bench_cli.main([str(a) for a in argv])


def read_runs(out) -> list[dict]:
    with open(out / "runs.csv", newline="") as f:
        return list(csv.DictReader(f))


@needs_torch
@pytest.mark.slow
def test_tiny_sweep_writes_runs_summary_table_and_plots(tmp_path):
    loaders = ["http-ooo", "http-inorder", "http-naive"] + (["webdataset"] if has_wds else [])
    out = tmp_path / "results"
    code = bench("--rtt", "0", "--loss", "0,0.1", "--rate", "unlimited", "--repeats", 1, "--seconds", 0.5,
                 "--images", 120, "--workers", 2, "--loaders", ",".join(loaders), "--out", out)
    assert code == 0

    runs = read_runs(out)
    measured = [r for r in runs if r["loss_pct"] == "0.0"]
    assert sorted(r["loader"] for r in measured) == sorted(loaders)
    assert all(r["status"] == "ok" and float(r["samples_per_s"]) > 0 and float(r["first_batch_s"]) > 0
               and float(r["cpu_per_1k"]) > 0 for r in measured), measured
    lossy = [r for r in runs if r["loss_pct"] == "0.1"]
    assert len(lossy) == len(loaders) and all(r["status"].startswith("n/a") for r in lossy)

    doc = json.loads((out / "summary.json").read_text())
    assert doc["meta"]["link"] == "proxy" and doc["meta"]["images"] == 120
    assert doc["meta"]["command"].startswith("dataferry bench --out ")
    assert "--rtt 0 --loss 0,0.1 --rate unlimited --loaders " in doc["meta"]["command"]
    assert {(r["loader"], r["loss_pct"]) for r in doc["summary"]} == {(n, loss) for n in loaders for loss in (0, 0.1)}

    table = (out / "table.md").read_text()
    throughput = table.split("## Throughput (samples/s): rate unlimited, loss 0%")[1].split("##")[0]
    rows = [line for line in throughput.splitlines() if line.startswith("|")][2:]
    assert [row.split("|")[1].strip() for row in rows] == loaders
    assert "## Rate unlimited, loss 0.1%\n\nNot measured: the latency proxy does not drop packets" in table
    for png in PNGS:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / png).stat().st_size < 200_000


def made_up_summary() -> dict:
    rows = []
    for loader in ("http-ooo", "http-naive", "webdataset"):
        for rate in (None, "1gbit"):
            for loss in (0.0, 0.1):
                for rtt in (0.0, 50.0, 200.0):
                    row = {"loader": loader, "rtt_ms": rtt, "loss_pct": loss, "rate": rate, "jitter_ms": 0.0,
                           "runs": 3, "status": "ok", "samples_per_s": 1000.0 / (1 + rtt / 10),
                           "mb_per_s": 100.0, "first_batch_s": 0.1 + rtt / 100, "cpu_per_1k": 0.5}
                    if loss:
                        row |= {"runs": 0, "status": "n/a: no loss here", "samples_per_s": None, "mb_per_s": None,
                                "first_batch_s": None, "cpu_per_1k": None}
                    rows.append(row)
    failed = next(r for r in rows if r["loader"] == "webdataset" and r["rtt_ms"] == 200.0 and r["status"] == "ok")
    failed |= {"runs": 0, "status": "error: RuntimeError: boom", "samples_per_s": None, "mb_per_s": None,
               "first_batch_s": None, "cpu_per_1k": None}
    meta = {"link": "proxy", "images": 2000, "mean_kb": 111.0, "dataset_mb": 222.0, "total_s": 600.0,
            "command": "dataferry bench", "date": "today", "machine": "here"}
    return {"meta": meta, "options": SweepOptions(workers=2).to_json(), "loaders": LOADERS, "summary": rows}


def test_report_pivots_every_measure_and_marks_gaps(tmp_path):
    doc = made_up_summary()
    table = render_markdown(doc)
    assert table.count("## Throughput (samples/s)") == 2  # unlimited and 1gbit
    assert table.count("## Time to first batch (s)") == 1 and table.count("## Client CPU per 1,000 samples") == 1
    assert table.count("Not measured: no loss here.") == 2
    flat = " ".join(table.split())
    assert "| loader | 0 ms | 50 ms | 200 ms | 200 vs 0 ms |" in flat
    assert "| http-naive | 1,000 | 167 | 48 | 5% |" in flat
    assert "| webdataset | 1,000 | 167 | failed | - |" in flat
    assert "http-inorder" not in table  # not in the sweep, not in the tables
    assert "a rate caps each TCP connection on its own" in table  # the proxy's rate is not a link rate
    paths = write_plots(doc, tmp_path)
    assert [p.name for p in paths] == list(PNGS)
    assert all(p.stat().st_size < 200_000 for p in paths)


def test_quick_preset_and_explicit_options(monkeypatch):
    parser = bench_cli.argparse.ArgumentParser()
    bench_cli.add_cli_arguments(parser)
    args = parser.parse_args(["--quick", "--repeats", "3", "--no-cql"])
    opts = bench_cli.options_from(args)
    assert opts.images == bench_cli.QUICK["images"] and opts.rtts == bench_cli.QUICK["rtts"]
    assert opts.repeats == 3  # given explicitly: wins over the preset
    assert not any(name.startswith("cql-") for name in opts.loaders) and "webdataset" in opts.loaders
    assert bench_cli.command_line(args) == "dataferry bench --quick --no-cql --repeats 3"
    args = parser.parse_args(["--rate", "unlimited,1gbit", "--rtt", "0,12.5"])
    opts = bench_cli.options_from(args)
    assert opts.rates == (None, "1gbit") and opts.rtts == (0.0, 12.5)
    assert [c.rate_label for c in opts.conditions()][::len(opts.rtts) * len(opts.losses)] == ["unlimited", "1gbit"]
    assert SweepOptions.from_json(json.loads(json.dumps(opts.to_json()))) == opts
    with pytest.raises(ConfigError, match="unknown loaders"):
        SweepOptions(loaders=("http-ooo", "nope"))
    with pytest.raises(ConfigError, match="repeats must be at least 1"):
        SweepOptions(repeats=0)


def test_links_say_what_they_cannot_emulate():
    assert ProxyLink().unsupported(Condition(50, 0.0)) is None
    assert ProxyLink().unsupported(Condition(50, 0.1)).startswith("n/a:")
    assert NamespaceLink("x", netem=True).unsupported(Condition(50, 0.1)) is None
    assert NamespaceLink("x", netem=False).unsupported(Condition(50, 0.1)).startswith("n/a:")
    assert NamespaceLink("x", netem=False).wrap == ("ip", "netns", "exec", "x-srv")


@pytest.mark.skipif(not is_root, reason="needs root and iproute2")
def test_netem_link_on_a_kernel_without_netem_exits_3(tmp_path, capfd):
    if bench_cli.subprocess.run([NETEM_SCRIPTS / "check.sh"], capture_output=True).returncode != 3:
        pytest.skip("this kernel has sch_netem")
    code = bench("--link", "netem", "--rtt", "0,10", "--out", tmp_path, "--netem-prefix", f"dftb{os.getpid() % 10000}")
    assert code == 3
    assert "dataferry latency-proxy" in capfd.readouterr().err
    assert not (tmp_path / "runs.csv").exists()


@needs_torch
@pytest.mark.slow
@pytest.mark.skipif(not is_root, reason="needs root and iproute2")
def test_veth_link_runs_in_namespaces_and_tears_down(tmp_path):
    prefix = f"dftb{os.getpid() % 10000}"
    out = tmp_path / "veth"
    code = bench("--link", "veth", "--netem-prefix", prefix, "--rtt", "0,20", "--loss", "0", "--rate", "40mbit",
                 "--loaders", "http-ooo", "--repeats", 1, "--seconds", 0.5, "--images", 60, "--out", out)
    assert code == 0
    runs = read_runs(out)
    assert [(r["rtt_ms"], r["status"]) for r in runs] == [("0.0", "ok"), ("20.0", "ok")]
    # the tbf caps the link at 40 mbit/s, 5 MB/s: a first batch of 64 samples of ~110 KB takes
    # more than 1.4 s (unshaped, a tenth of that); the steady state of so short a run says little
    assert all(float(r["first_batch_s"]) > 1.2 for r in runs), runs
    netns = bench_cli.subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in netns
