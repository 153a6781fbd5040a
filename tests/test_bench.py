"""``dataferry bench``: the sweep machinery end to end on a tiny dataset, the
report from a made-up summary, the options, and the namespace links as root."""

from __future__ import annotations

import csv
import gc
import importlib.util
import json
import multiprocessing
import os
import shutil
import time

import pytest

from dataferry.bench import cli as bench_cli
from dataferry.bench._common import live_descendants, measure_loader
from dataferry.bench._links import NETEM_SCRIPTS, Condition, NamespaceLink, ProxyLink
from dataferry.bench.report import render_markdown, write_plots
from dataferry.bench.sweep import LOADERS, S3_LOADERS, SweepOptions
from dataferry.schema import ConfigError

has_wds = importlib.util.find_spec("webdataset") is not None
has_torch = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not has_torch, reason="the naive and WebDataset loaders need torch")
is_root = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None

PNGS = ("throughput.png", "first_batch.png", "cpu.png", "inflight.png")


def bench(*argv) -> int:
    return bench_cli.main([str(a) for a in argv])


def read_runs(out) -> list[dict]:
    with open(out / "runs.csv", newline="") as f:
        return list(csv.DictReader(f))


def s3_peer_missing(name: str) -> str | None:
    """Why the S3 peer ``name`` (MosaicML Streaming or LitData) cannot run here, or None."""
    try:
        from dataferry.bench import _s3peers
    except ImportError as exc:
        return f"bench/_s3peers.py cannot be imported ({exc})"
    return _s3peers.available(name)


@needs_torch
@pytest.mark.slow
def test_tiny_sweep_writes_runs_summary_table_and_plots(tmp_path):
    loaders = ["http-ooo", "http-inorder", "http-concurrent", "http-naive"] + (["webdataset"] if has_wds else [])
    loaders += list(S3_LOADERS)
    out = tmp_path / "results"
    code = bench("--rtt", "0", "--loss", "0,0.1", "--rate", "unlimited", "--repeats", 1, "--seconds", 0.5,
                 "--images", 160, "--workers", 2, "--naive-workers", 3, "--concurrent-workers", 2, "--pool", 4,
                 "--batch-size", 16, "--loaders", ",".join(loaders), "--out", out)
    assert code == 0

    runs = read_runs(out)
    measured = {r["loader"]: r for r in runs if r["loss_pct"] == "0.0"}
    assert sorted(measured) == sorted(loaders)
    for name, r in measured.items():
        missing = s3_peer_missing(name) if name in S3_LOADERS else None
        if missing:
            assert r["status"] == f"n/a: {missing}", r  # recorded, and the sweep went on
            continue
        assert r["status"] == "ok" and float(r["samples_per_s"]) > 0 and float(r["first_batch_s"]) > 0 \
            and float(r["cpu_per_1k"]) > 0, r
        # at most one epoch (the default): 160 samples, the first batch and the last included
        assert int(r["samples"]) + int(r["first_samples"]) <= 160 and r["within_epoch"] == "True", r
    # in flight: the engine's own count for ours (several samples a request), the configuration for the peers
    assert 1 <= float(measured["http-ooo"]["inflight"]) <= float(measured["http-ooo"]["inflight_peak"]) <= 4096
    assert float(measured["http-ooo"]["per_request"]) >= 1
    assert float(measured["http-naive"]["inflight"]) == 3 and float(measured["http-concurrent"]["inflight"]) == 8
    if has_wds:
        assert float(measured["webdataset"]["inflight"]) == 2
    lossy = [r for r in runs if r["loss_pct"] == "0.1"]
    assert len(lossy) == len(loaders) and all(r["status"].startswith("n/a") for r in lossy)

    doc = json.loads((out / "summary.json").read_text())
    assert doc["meta"]["link"] == "proxy" and doc["meta"]["images"] == 160
    assert doc["meta"]["command"].startswith("dataferry bench --out ")
    assert "--rtt 0 --loss 0,0.1 --rate unlimited --loaders " in doc["meta"]["command"]
    assert "--naive-workers 3 --concurrent-workers 2 --pool 4" in doc["meta"]["command"]
    assert {(r["loader"], r["loss_pct"]) for r in doc["summary"]} == {(n, loss) for n in loaders for loss in (0, 0.1)}
    assert doc["labels"]["http-naive"] == "http-naive (3 workers)"
    assert doc["labels"]["http-concurrent"] == "http-concurrent (2 workers x 4 threads)"
    ok = [r for r in doc["summary"] if r["status"] == "ok"]
    assert all(r["within_epoch"] is True and r["inflight"] for r in ok if r["loader"] not in S3_LOADERS), ok

    table = (out / "table.md").read_text()
    throughput = table.split("## Throughput (samples/s): rate unlimited, loss 0%")[1].split("##")[0]
    rows = [line for line in throughput.splitlines() if line.startswith("|")][2:]
    assert [row.split("|")[1].strip() for row in rows] == [doc["labels"][n] for n in loaders]
    assert "## Out of order and in order (samples/s): rate unlimited, loss 0%" in table
    assert "## Requests or streams in flight (mean): rate unlimited, loss 0%" in table
    assert "## Rate unlimited, loss 0.1%\n\nNot measured: the latency proxy does not drop packets" in table
    for png in PNGS:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / png).stat().st_size < 200_000


class _Bytes:
    """A dataset of ``n`` small byte strings (the DataLoader's own seam)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return b"x" * (i % 7 + 1), 0


def worker_pids(it, before: frozenset[int], batches: int) -> frozenset[int]:
    for _ in range(batches):
        next(it)
    return live_descendants() - before


@needs_torch
def test_naive_loaders_keep_their_configured_workers_across_epochs():
    from dataferry.bench._loaders import naive

    before = live_descendants()
    it = naive(_Bytes(40), batch_size=10, workers=3)()
    first = worker_pids(it, before, 1)
    again = worker_pids(it, before, 9)  # two epochs of 4 batches later
    assert len(first) == 3 and again == first  # persistent: the same 3 processes, not new ones each epoch
    assert it.in_flight() == (3, 3, 1.0)
    it.close()
    del it
    gc.collect()
    deadline = time.monotonic() + 10
    while live_descendants() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live_descendants() - before  # closed: its workers are gone


@needs_torch
@pytest.mark.skipif(not has_wds, reason="needs webdataset")
def test_webdataset_keeps_its_workers_across_epochs_and_batches_in_them(tmp_path):
    import webdataset as wds

    from dataferry.bench.webdataset_baseline import shard_size, webdataset_loader

    for shard in range(2):
        with wds.TarWriter(str(tmp_path / f"s-{shard}.tar")) as sink:
            for i in range(20):
                sink.write({"__key__": f"{shard}-{i}", "jpg": b"j" * (i + 1), "cls": i % 3})
    before = live_descendants()
    it = webdataset_loader([str(tmp_path / f"s-{i}.tar") for i in range(2)], batch_size=5, workers=2)()
    first = worker_pids(it, before, 1)
    again = worker_pids(it, before, 12)  # 8 batches an epoch
    assert len(first) == 2 and again == first
    assert next(it)[0] == 5  # batched in the workers, whole batches
    it.close()
    # ~100 MB shards; a dataset with less than one per worker gets one per worker, not slivers
    assert shard_size(int(2.2e9), workers=4) == int(100e6)
    assert shard_size(int(110e6), workers=4) == int(27.5e6)
    assert shard_size(10_000, workers=4) == 1 << 20


def _burn(seconds: float, done) -> None:
    while time.process_time() < seconds:
        pass
    done.send(True)
    time.sleep(60)  # alive, not reaped, until killed


def _spin() -> None:
    while True:
        pass


def test_cpu_counts_live_workers_of_the_loader_not_servers_started_before():
    ctx = multiprocessing.get_context("fork")
    server = ctx.Process(target=_spin, daemon=True)  # busy all through the run, never counted
    workers = []

    def make():
        ready, done = ctx.Pipe(duplex=False)
        worker = ctx.Process(target=_burn, args=(0.3, done), daemon=True)
        worker.start()
        workers.append(worker)

        def batches():
            ready.recv()  # the worker has burnt its CPU, and lives on
            while True:
                time.sleep(0.01)
                yield 1, 1

        return batches()

    server.start()  # a server: started before the run, busy during it
    try:
        before = os.times()
        m = measure_loader(make, seconds=0.4, max_samples=10**9)
        after = os.times()
    finally:
        for proc in (server, *workers):
            proc.kill()
            proc.join()
    # this process's own CPU in the run (every thread of it, the copy-on-write faults after a
    # fork of a large test process) is counted too, and varies: measured beside, not guessed
    own = after.user + after.system - before.user - before.system
    # the live worker's 0.3 s counted; the server's (at least half a core for 0.7 s or more) not
    assert 0.25 <= m.cpu - own < 0.3 + 0.15, (m.cpu, own)  # ticks of 10 ms, own read around the run


def made_up_summary() -> dict:
    rows = []
    for loader in ("http-ooo", "http-naive", "webdataset"):
        for rate in (None, "1gbit"):
            for loss in (0.0, 0.1):
                for rtt in (0.0, 50.0, 200.0):
                    ours = loader == "http-ooo"
                    row = {"loader": loader, "rtt_ms": rtt, "loss_pct": loss, "rate": rate, "jitter_ms": 0.0,
                           "runs": 3, "status": "ok", "samples_per_s": 1000.0 / (1 + rtt / 10),
                           "mb_per_s": 100.0, "first_batch_s": 0.1 + rtt / 100, "cpu_per_1k": 0.5,
                           "window_s": 5.0, "inflight": 12.4 if ours else 16.0, "inflight_peak": 40 if ours else 16,
                           "per_request": 26.0 if ours else 1.0, "within_epoch": True}
                    if loss:
                        row |= {"runs": 0, "status": "n/a: no loss here", "samples_per_s": None, "mb_per_s": None,
                                "first_batch_s": None, "cpu_per_1k": None, "window_s": None, "inflight": None,
                                "inflight_peak": None, "per_request": None, "within_epoch": None}
                    rows.append(row)
    failed = next(r for r in rows if r["loader"] == "webdataset" and r["rtt_ms"] == 200.0 and r["status"] == "ok")
    failed |= {"runs": 0, "status": "error: RuntimeError: boom", "samples_per_s": None, "mb_per_s": None,
               "first_batch_s": None, "cpu_per_1k": None, "inflight": None}
    short = next(r for r in rows if r["loader"] == "http-ooo" and r["rtt_ms"] == 0.0 and r["status"] == "ok")
    short |= {"window_s": 0.4, "within_epoch": False}
    meta = {"link": "proxy", "images": 2000, "mean_kb": 111.0, "dataset_mb": 222.0, "total_s": 600.0,
            "command": "dataferry bench", "date": "today", "machine": "here"}
    opts = SweepOptions(workers=2, loaders=("http-ooo", "http-naive", "webdataset"))
    names = opts.loaders
    return {"meta": meta, "options": opts.to_json(), "loaders": {n: LOADERS[n] for n in names},
            "labels": {n: opts.label(n) for n in names}, "in_flight": {n: opts.in_flight_basis(n) for n in names},
            "summary": rows}


def test_report_pivots_every_measure_and_marks_gaps(tmp_path):
    doc = made_up_summary()
    table = render_markdown(doc)
    assert table.count("## Throughput (samples/s)") == 2  # unlimited and 1gbit
    assert table.count("## Time to first batch (s)") == 1 and table.count("## Client CPU per 1,000 samples") == 1
    assert table.count("Not measured: no loss here.") == 2
    flat = " ".join(table.split())
    assert "| loader | 0 ms | 50 ms | 200 ms | 200 vs 0 ms |" in flat
    assert "| http-naive (16 workers) | 1,000 | 167 | 48 | 5% |" in flat  # labelled with its concurrency
    assert "| webdataset (2 workers) | 1,000 | 167 | failed | - |" in flat
    assert "| http-ooo | 1,000*† | 167 | 48 | 5% |" in flat  # more than one epoch, in too short a window
    assert "`*`: the run read more than one epoch" in table and "`†`: the run reached one epoch in less than" in table
    assert table.count("## Requests or streams in flight (mean)") == 1
    assert "| http-ooo | 12 x26 | 12 x26 | 12 x26 |" in flat  # requests of 26 samples each
    assert "| http-naive (16 workers) | 16 | 16 | 16 |" in flat
    assert "`http-naive` configured: 16 workers x 1 blocking request" in table
    assert "http-inorder" not in table and "Out of order and in order" not in table  # not in the sweep
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
    with pytest.raises(ConfigError, match="naive_workers must be at least 1"):
        SweepOptions(naive_workers=0)
    nan = float("nan")
    for bad in ({"rtts": (0.0, nan)}, {"losses": (nan,)}, {"seconds": nan}, {"shard_mb": nan}, {"jitter_ms": nan},
                {"rtts": (float("inf"),)}):
        with pytest.raises(ConfigError, match="finite"):
            SweepOptions(**bad)


def test_the_default_sweep_has_competent_peers_and_no_tiny_epoch():
    opts = SweepOptions()
    assert opts.images >= 20_000 and opts.max_samples is None  # each run reads at most one epoch of 20,000
    assert 16 <= opts.naive_workers <= 32 and opts.concurrent_workers * opts.pool >= 64 and opts.shard_mb == 100
    assert {"http-concurrent", "mosaic", "litdata", "webdataset", "http-naive"} <= set(opts.loaders)
    assert opts.label("http-naive") == "http-naive (16 workers)"
    # about 30 minutes: 4 RTTs, one rate, no loss (the proxy cannot drop), 3 repeats
    assert len(opts.conditions()) == 4 and opts.repeats == 3 and opts.seconds <= 5


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


def test_the_headline_counts_every_sample_from_creating_the_loader_and_report_remakes_it_from_runs(tmp_path):
    from dataferry.bench import report
    from dataferry.bench._common import Measurement
    from dataferry.bench.sweep import Run, Sweep, read_runs, summarize, write_results

    # 64 samples in a first batch after 2 s, then 936 in 3 s: 1,000 over 5 s from creation, 312/s after the first
    m = Measurement(samples=936, bytes=936_000, seconds=3.0, first_batch=2.0, cpu=1.0, first_samples=64)
    assert m.total_per_s == 200.0 and m.samples_per_s == 312.0
    opts = SweepOptions(loaders=("http-ooo", "http-naive"), rtts=(0.0, 100.0), repeats=1, workers=2, seconds=3.0)
    runs = [Run("http-ooo", Condition(0.0), 0, "ok", m), Run("http-ooo", Condition(100.0), 0, "ok", m),
            Run("http-naive", Condition(0.0), 0, "ok", m), Run("http-naive", Condition(100.0), 0, "n/a: not here")]
    meta = {"link": "proxy", "images": 20_000, "mean_kb": 1.0, "dataset_mb": 20.0, "total_s": 60.0,
            "command": "dataferry bench", "date": "today", "machine": "here"}
    write_results(Sweep(opts, runs, meta), tmp_path)
    again = read_runs(tmp_path / "runs.csv")
    assert summarize(again, 20_000) == summarize(runs, 20_000)  # runs.csv keeps everything the medians need
    table = (tmp_path / "table.md").read_text()
    flat = " ".join(table.split())
    assert "## What a user sees, all samples over the wall time from creating the loader to the last batch" in table
    assert "| http-ooo | 200 | 200 | 100% |" in flat and "| http-ooo | 312 | 312 | 100% |" in flat
    doc = json.loads((tmp_path / "summary.json").read_text())
    for row in doc["summary"]:
        row.pop("total_per_s")  # a summary written before the headline figure existed
    (tmp_path / "summary.json").write_text(json.dumps(doc))
    assert report.main([str(tmp_path)]) == 0
    assert "| http-ooo | 200 | 200 | 100% |" in " ".join((tmp_path / "table.md").read_text().split())


def test_the_cluster_bench_child_reads_one_epoch_through_the_service(capsys):
    """``bench.cql_cluster --child URL`` (``_common.loader_epoch``, which ``cql_path`` shares): one epoch
    over the data service, every sample once, with the engine's window figures; no times checked."""
    from dataferry.bench import cql_cluster
    from dataferry.bench._common import data_server, prepared_store

    with prepared_store("sqlite", 40, cql_cluster.DATASET) as (url, _, _), data_server(url) as (host, port):
        assert cql_cluster.main(["--child", f"http://{host}:{port}", "--batch-size", "16"]) == 0
    run = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert run["samples"] == 40 and run["first_samples"] == 16 and run["served"] >= 40
    assert run["requests"] >= 1 and run["failures"] == 0 and "t0" not in run
    assert {"first_batch_s", "total_per_s", "cpu_us_per_sample", "mean_inflight", "window_full_share"} <= set(run)


def test_the_cluster_bench_refuses_unknown_parts():
    from dataferry.bench import cql_cluster

    with pytest.raises(SystemExit) as exc:
        cql_cluster.main(["--parts", "ingest,scan"])
    assert exc.value.code == 2
