"""The sweep behind ``dataferry bench``: every loader across a grid of links.

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ._common import Measurement, all_ids, data_server, measure_loader, prepared_store
from ._links import Condition, NamespaceLink

__all__ = ["LOADERS", "SweepOptions", "Run", "Sweep", "run_sweep", "summarize", "run_and_report", "write_results",
           "read_runs"]

#: name -> what it is; the order of tables and legends
LOADERS: dict[str, str] = {
    "http-ooo": "ours, data service over HTTP, out of order",
    "http-inorder": "ours, data service over HTTP, in order",
    "http-concurrent": "ConcurrentDataloader-style: persistent torch DataLoader workers, each fetching its batch "
                       "with a pool of threads, one HTTP request per sample",
    "http-naive": "torch DataLoader, persistent workers, one blocking HTTP request per sample",
    "cql-ooo": "ours, Cassandra over CQL, out of order",
    "cql-inorder": "ours, Cassandra over CQL, in order",
    "cql-naive": "torch DataLoader, persistent workers, one blocking CQL query per sample",
    "webdataset": "WebDataset tar shards over HTTP, batched in persistent torch DataLoader workers",
    "mosaic": "MosaicML Streaming (MDS shards) from a local S3 server (moto) across the link",
    "litdata": "LitData (optimized chunks) from a local S3 server (moto) across the link",
}
#: loaders that read the S3 datasets of :mod:`._s3peers`
S3_LOADERS = ("mosaic", "litdata")
DATASET = "bench"


@dataclass(frozen=True, slots=True)
class SweepOptions:
    images: int = 20_000
    rtts: tuple[float, ...] = (0, 50, 100, 200)
    losses: tuple[float, ...] = (0.0,)
    rates: tuple[str | None, ...] = (None,)
    jitter_ms: float = 0.0
    loaders: tuple[str, ...] = tuple(LOADERS)
    repeats: int = 3
    seconds: float = 4.0  # steady state per run, after the first batch
    max_samples: int | None = None  # per run, the first batch included; None: one epoch
    batch_size: int = 64
    workers: int = 4  # DataLoader workers of WebDataset, MosaicML Streaming and LitData
    naive_workers: int = 16  # DataLoader workers of the naive loaders, one request in flight each
    concurrent_workers: int = 4  # DataLoader workers of http-concurrent ...
    pool: int = 16  # ... each with this many requests in flight
    inflight: int | None = None  # a cap on the engine's requests in flight; None: its default
    concurrency: int = 768  # CQL requests in flight per store
    shard_mb: float = 100.0

    def __post_init__(self) -> None:
        from dataferry.schema import ConfigError

        unknown = [n for n in self.loaders if n not in LOADERS]
        if unknown or not self.loaders:
            raise ConfigError(f"unknown loaders {unknown or '(none)'}; choose from {', '.join(LOADERS)}")

        def nonneg(v: float) -> bool:  # NaN compares False with everything: test finiteness, not just the sign
            return math.isfinite(v) and v >= 0

        if not (self.rtts and self.losses and self.rates and all(map(nonneg, (*self.rtts, *self.losses)))):
            raise ConfigError("RTTs and losses are finite and >= 0, and each list has at least one value")
        for name in ("images", "repeats", "batch_size", "workers", "naive_workers", "concurrent_workers", "pool",
                     "concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_samples", "inflight"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1 (or None: the default), got {getattr(self, name)}")
        if not (nonneg(self.seconds) and self.seconds > 0 and nonneg(self.shard_mb) and self.shard_mb > 0
                and nonneg(self.jitter_ms)):
            raise ConfigError("seconds and shard size must be finite and > 0, jitter finite and >= 0")

    def conditions(self) -> list[Condition]:
        return [Condition(rtt, loss, rate, self.jitter_ms)
                for rate in self.rates for loss in self.losses for rtt in self.rtts]

    def label(self, name: str) -> str:
        """``name`` with the concurrency it runs with, for tables and legends."""
        workers = {"http-naive": self.naive_workers, "cql-naive": self.naive_workers,
                   "webdataset": self.workers, "mosaic": self.workers, "litdata": self.workers}
        if name in workers:
            return f"{name} ({workers[name]} workers)"
        if name == "http-concurrent":
            return f"{name} ({self.concurrent_workers} workers x {self.pool} threads)"
        return name

    def in_flight_basis(self, name: str) -> str:
        """What the in-flight figure of loader ``name`` counts."""
        if name in S3_LOADERS:
            return "as the loader reports it (none: not counted)"
        if name.endswith("-naive"):
            return f"configured: {self.naive_workers} workers x 1 blocking request"
        if name == "http-concurrent":
            return f"configured: {self.concurrent_workers} workers x {self.pool} threads, 1 request each"
        if name == "webdataset":
            return f"configured: {self.workers} workers x 1 HTTP stream (curl, one shard at a time)"
        cap = "the engine's own cap" if self.inflight is None else f"at most {self.inflight}"
        return (f"measured: the engine's requests in flight at each batch, mean and peak ({cap}); "
                "each request carries several samples")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> SweepOptions:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


@dataclass(frozen=True, slots=True)
class Run:
    loader: str
    cond: Condition
    repeat: int
    status: str  # "ok", "n/a: why", "error: what"
    m: Measurement | None = None


@dataclass(frozen=True, slots=True)
class Sweep:
    options: SweepOptions
    runs: list[Run]
    meta: dict


@dataclass(frozen=True, slots=True)
class _Servers:
    ids: list[int]
    http: tuple[str, int]
    files: tuple[str, int] | None
    shards: tuple[str, ...]
    cql_url: str | None
    cql: tuple[str, int] | None
    s3: tuple[str, int] | None = None
    mds_remote: str = ""
    litdata_remote: str = ""
    #: S3 peer -> why it cannot run: "n/a: ..." (not installed here) or "error: ..." (its data could not be made)
    s3_missing: dict[str, str] = dataclasses.field(default_factory=dict)


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _start(stack: contextlib.ExitStack, opts: SweepOptions, link) -> tuple[_Servers, dict]:
    from .webdataset_baseline import file_server, shard_size, write_shards

    t0 = time.perf_counter()
    sqlite_url, _, report = stack.enter_context(prepared_store("sqlite", opts.images, DATASET))
    ids = all_ids(sqlite_url, DATASET)
    http = stack.enter_context(data_server(sqlite_url, host=link.host, wrap=link.wrap))
    meta = {"images": report.num_samples, "mean_kb": round(report.bytes_out / max(report.num_samples, 1) / 1e3, 1),
            "dataset_mb": round(report.bytes_out / 1e6, 1)}
    files, shards = None, ()
    if "webdataset" in opts.loaders:
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="dataferry-shards-"))
        per_shard = shard_size(report.bytes_out, workers=opts.workers, target=opts.shard_mb * 1e6)
        shards = tuple(write_shards(sqlite_url, DATASET, folder, shard_bytes=per_shard))
        files = stack.enter_context(file_server(folder, host=link.host, wrap=link.wrap))
        meta["shards"] = len(shards)
        meta["shard_mb"] = round(sum(os.path.getsize(os.path.join(folder, s)) for s in shards) / len(shards) / 1e6, 1)
    s3 = {}
    if any(n in S3_LOADERS for n in opts.loaders):
        s3 = _s3_datasets(stack, opts, link, sqlite_url)
        meta["s3"] = {n: s3.get("s3_missing", {}).get(n, "ok") for n in S3_LOADERS if n in opts.loaders}
    cql_url = cql = None
    if any(n.startswith("cql-") for n in opts.loaders):
        cql_url, cql = stack.enter_context(link.cassandra(opts.images))
    meta["setup_s"] = round(time.perf_counter() - t0, 1)
    _log(f"bench: {meta['images']} images of {meta['mean_kb']:.0f} KB mean; link {link.name}; "
         f"set up in {meta['setup_s']:.0f} s")
    return _Servers(ids, http, files, shards, cql_url, cql, **s3), meta


def _s3_datasets(stack: contextlib.ExitStack, opts: SweepOptions, link, sqlite_url: str) -> dict:
    """The S3 server and datasets of the MosaicML Streaming and LitData peers
    in the sweep, as :class:`_Servers` fields; ``s3_missing`` says why a peer has none."""
    wanted = [n for n in S3_LOADERS if n in opts.loaders]
    try:
        from . import _s3peers
    except ImportError as exc:
        return {"s3_missing": {n: f"n/a: bench/_s3peers.py cannot be imported ({exc})" for n in wanted}}
    missing = {}
    for name in wanted:
        why = _s3peers.available(name)
        if why is not None:
            _log(f"bench: {name} not measured: {why}")
            missing[name] = f"n/a: {why}"
    peers = [n for n in wanted if n not in missing]
    if not peers:
        return {"s3_missing": missing}
    try:
        data = stack.enter_context(_s3peers.s3_datasets(sqlite_url, DATASET, host=link.host, wrap=link.wrap,
                                                        shard_mb=opts.shard_mb, peers=peers))
    except Exception as exc:  # noqa: BLE001 - recorded for their runs, and the sweep goes on
        _log(f"bench: the S3 datasets could not be made: {type(exc).__name__}: {exc}")
        why = f"error: the S3 datasets could not be made: {type(exc).__name__}: {exc}"
        return {"s3_missing": missing | {n: why for n in peers}}
    return {"s3": tuple(data.endpoint), "mds_remote": data.mds_remote or "", "litdata_remote": data.litdata_remote or "",
            "s3_missing": missing}


def _factory(name: str, servers: _Servers, opts: SweepOptions):
    """The loader ``name`` reading ``servers`` (already routed across the link)."""
    from ._loaders import ConcurrentHttpDataset, NaiveCqlDataset, NaiveHttpDataset, concurrent, naive, ours, \
        with_options
    from .webdataset_baseline import webdataset_loader

    if name == "webdataset":
        host, port = servers.files
        urls = [f"http://{host}:{port}/{shard}" for shard in servers.shards]
        return webdataset_loader(urls, batch_size=opts.batch_size, workers=opts.workers)
    if name in S3_LOADERS:
        from . import _s3peers

        host, port = servers.s3
        factory, remote = ((_s3peers.mosaic, servers.mds_remote) if name == "mosaic"
                           else (_s3peers.litdata, servers.litdata_remote))
        return factory(f"http://{host}:{port}", remote, batch_size=opts.batch_size, workers=opts.workers)
    path, _, kind = name.partition("-")
    order = "input" if kind == "inorder" else "completion"
    if path == "http":
        host, port = servers.http
        if kind == "naive":
            return naive(NaiveHttpDataset((host, port), DATASET, servers.ids), batch_size=opts.batch_size,
                         workers=opts.naive_workers)
        if kind == "concurrent":
            return concurrent(ConcurrentHttpDataset((host, port), DATASET, servers.ids, pool=opts.pool),
                              batch_size=opts.batch_size, workers=opts.concurrent_workers)
        return ours(f"http://{host}:{port}", DATASET, order=order, batch_size=opts.batch_size, inflight=opts.inflight)
    host, port = servers.cql
    url = with_options(servers.cql_url, host, port, concurrency=opts.concurrency, request_timeout=30)
    if kind == "naive":
        return naive(NaiveCqlDataset(url, DATASET, servers.ids), batch_size=opts.batch_size,
                     workers=opts.naive_workers)
    return ours(url, DATASET, order=order, batch_size=opts.batch_size, inflight=opts.inflight)


def _routed(name: str, servers: _Servers, route) -> _Servers:
    """``servers`` with the one ``name`` reads replaced by its address across the link."""
    field = ("files" if name == "webdataset" else "s3" if name in S3_LOADERS
             else name.partition("-")[0])  # "http" or "cql"
    return dataclasses.replace(servers, **{field: route(getattr(servers, field))})


#: Each run gets a fresh process forked from a forkserver that has imported the
#: loaders: a run cannot inherit another's threads, sockets or leftovers, and
#: its CPU is its own and its workers'. (The cassandra-driver IO thread that
#: once spun a core half a minute after a CQL Loader closed is fixed at its
#: root, in ``schema/sources/cassandra/_driver_patches.py``; ``tests/test_cql_shutdown.py``.)
_PRELOAD = ["dataferry.bench._loaders", "dataferry.bench.webdataset_baseline", "dataferry.client", "numpy",
            "torch.utils.data", "webdataset", "cassandra.cluster", "dataferry.bench._s3peers"]  # missing: skipped


def _measure_in_child(conn, name: str, servers: _Servers, opts: SweepOptions) -> None:
    try:
        # by default at most one epoch, the last batch included
        epoch = max(len(servers.ids) - opts.batch_size + 1, 1)
        conn.send(measure_loader(_factory(name, servers, opts), seconds=opts.seconds,
                                 max_samples=opts.max_samples or epoch))
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        conn.send(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def _measure_isolated(name: str, servers: _Servers, opts: SweepOptions) -> Measurement:
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_measure_in_child, args=(send, name, servers, opts), name=f"bench-{name}")
    proc.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"the measuring process died (exit code {proc.exitcode})") from None
    finally:
        receive.close()
    proc.join(30)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
    if isinstance(result, str):
        raise RuntimeError(result)
    return result


def _run_one(name: str, cond: Condition, repeat: int, servers: _Servers, route, opts: SweepOptions) -> Run:
    if name in servers.s3_missing:
        return Run(name, cond, repeat, servers.s3_missing[name])
    try:
        m = _measure_isolated(name, _routed(name, servers, route), opts)
    except Exception as exc:  # noqa: BLE001 - recorded, and the sweep goes on
        _log(f"  {name:<15} run {repeat + 1}: failed: {type(exc).__name__}: {exc}")
        return Run(name, cond, repeat, f"error: {exc}")
    inflight = "" if m.inflight is None else f"  in flight {m.inflight:,.0f}"
    _log(f"  {name:<15} run {repeat + 1}: {m.total_per_s:>8,.0f} samples/s from start  "
         f"({m.samples_per_s:,.0f}/s after the first batch, {m.mb_per_s:,.1f} MB/s)  "
         f"first batch {m.first_batch:5.2f} s  cpu {m.cpu_per_1k:5.2f} s/1k{inflight}")
    return Run(name, cond, repeat, "ok", m)


def run_sweep(opts: SweepOptions, link) -> Sweep:
    """Run every loader under every condition of ``opts`` across ``link``."""
    t0 = time.perf_counter()
    runs: list[Run] = []
    with contextlib.ExitStack() as stack:
        servers, meta = _start(stack, opts, link)
        for cond in opts.conditions():
            why = link.unsupported(cond)
            if why:
                _log(f"{cond.describe()}: {why}")
                runs += [Run(name, cond, 0, why) for name in opts.loaders]
                continue
            _log(f"{cond.describe()}:")
            with link.emulate(cond) as route:
                for repeat in range(opts.repeats):
                    runs += [_run_one(name, cond, repeat, servers, route, opts) for name in opts.loaders]
    meta["sweep_s"] = round(time.perf_counter() - t0, 1)
    return Sweep(opts, runs, meta)


def within_epoch(m: Measurement, epoch: int) -> bool:
    """Whether run ``m`` read no more samples than one epoch of ``epoch`` holds, its first batch included."""
    return m.samples + m.first_samples <= epoch


def summarize(runs: list[Run], epoch: int | None = None) -> list[dict]:
    """One row per (loader, condition): the medians of its successful runs;
    with ``epoch`` (samples in one), whether every run stayed within one."""
    groups: dict[tuple[str, Condition], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.loader, run.cond), []).append(run)
    rows = []
    for (loader, cond), group in groups.items():
        ok = [r.m for r in group if r.status == "ok"]
        row = {"loader": loader, **dataclasses.asdict(cond), "runs": len(ok),
               "status": "ok" if ok else group[0].status}
        for key, value in (("total_per_s", lambda m: m.total_per_s),
                           ("samples_per_s", lambda m: m.samples_per_s), ("mb_per_s", lambda m: m.mb_per_s),
                           ("first_batch_s", lambda m: m.first_batch), ("cpu_per_1k", lambda m: m.cpu_per_1k),
                           ("window_s", lambda m: m.seconds),
                           ("inflight", lambda m: m.inflight), ("inflight_peak", lambda m: m.inflight_peak),
                           ("per_request", lambda m: m.per_request)):
            values = [v for v in map(value, ok) if v is not None]
            row[key] = statistics.median(values) if values else None
        row["within_epoch"] = all(within_epoch(m, epoch) for m in ok) if ok and epoch else None
        rows.append(row)
    return rows


_RUN_FIELDS = ["loader", "rtt_ms", "loss_pct", "rate", "jitter_ms", "repeat", "status", "samples", "first_samples",
               "bytes", "seconds", "first_batch_s", "cpu_s", "total_per_s", "samples_per_s", "mb_per_s", "cpu_per_1k", "inflight",
               "inflight_peak", "per_request", "within_epoch"]


def read_runs(path: Path) -> list[Run]:
    """The runs of a ``runs.csv`` that :func:`write_results` wrote (their measurements rebuilt)."""
    from ._common import Measurement

    def num(text: str) -> float | None:
        return float(text) if text else None

    runs = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            cond = Condition(float(row["rtt_ms"]), float(row["loss_pct"]),
                             None if row["rate"] == "unlimited" else row["rate"], float(row["jitter_ms"]))
            m = None
            if row["status"] == "ok":
                m = Measurement(int(row["samples"]), int(row["bytes"]), float(row["seconds"]), float(row["first_batch_s"]),
                                float(row["cpu_s"]), int(row["first_samples"]), num(row["inflight"]),
                                num(row["inflight_peak"]), num(row["per_request"]))
            runs.append(Run(row["loader"], cond, int(row["repeat"]) - 1, row["status"], m))
    return runs


def write_results(sweep: Sweep, out: Path) -> list[Path]:
    """Write runs.csv, summary.json, table.md and the plots under ``out``; return the paths."""
    from .report import render_markdown, write_plots

    out.mkdir(parents=True, exist_ok=True)
    epoch = sweep.meta["images"]
    with open(out / "runs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, _RUN_FIELDS)
        writer.writeheader()
        for run in sweep.runs:
            row = {"loader": run.loader, **dataclasses.asdict(run.cond), "repeat": run.repeat + 1, "status": run.status}
            row["rate"] = run.cond.rate_label
            if run.m is not None:
                m = run.m
                row |= {"samples": m.samples, "first_samples": m.first_samples, "bytes": m.bytes,
                        "seconds": f"{m.seconds:.3f}", "first_batch_s": f"{m.first_batch:.3f}", "cpu_s": f"{m.cpu:.3f}",
                        "total_per_s": f"{m.total_per_s:.1f}",
                        "samples_per_s": f"{m.samples_per_s:.1f}", "mb_per_s": f"{m.mb_per_s:.2f}",
                        "cpu_per_1k": f"{m.cpu_per_1k:.3f}", "within_epoch": within_epoch(m, epoch)}
                for key in ("inflight", "inflight_peak", "per_request"):
                    value = getattr(m, key)
                    row[key] = "" if value is None else f"{value:.1f}"
            writer.writerow(row)
    summary = summarize(sweep.runs, epoch)
    opts = sweep.options
    names = [n for n in LOADERS if n in opts.loaders]
    doc = {"meta": sweep.meta, "options": opts.to_json(), "loaders": {n: LOADERS[n] for n in names},
           "labels": {n: opts.label(n) for n in names}, "in_flight": {n: opts.in_flight_basis(n) for n in names},
           "summary": summary}
    (out / "summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "table.md").write_text(render_markdown(doc))
    return [out / "runs.csv", out / "summary.json", out / "table.md", *write_plots(doc, out)]


def run_and_report(opts: SweepOptions, link, out: Path, command: str) -> int:
    """Sweep, write the results, print the table; 1 if any run failed."""
    from importlib import metadata

    import torch
    import webdataset

    t0 = time.perf_counter()
    sweep = run_sweep(opts, link)
    sweep.meta.update({"total_s": round(time.perf_counter() - t0, 1),
        "command": command, "link": link.name,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, Linux {platform.release()}",
        "python": platform.python_version(), "torch": torch.__version__, "webdataset": webdataset.__version__,
    })
    for package in ("mosaicml-streaming", "litdata", "moto"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            sweep.meta[package] = metadata.version(package)
    paths = write_results(sweep, out)
    print((out / "table.md").read_text())
    print(f"bench: {sweep.meta['total_s']:.0f} s; wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 1 if any(r.status.startswith("error") for r in sweep.runs) else 0


def _netns_child(argv: list[str] | None = None) -> int:
    """The half of ``dataferry bench --link netem|veth`` that runs inside the client namespace."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m dataferry.bench.sweep")
    p.add_argument("--netns-prefix", required=True)
    p.add_argument("--link", choices=("netem", "veth"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--options", required=True, help="SweepOptions as JSON")
    p.add_argument("--command", default="")
    args = p.parse_args(argv)
    opts = SweepOptions.from_json(json.loads(args.options))
    link = NamespaceLink(args.netns_prefix, netem=args.link == "netem")
    return run_and_report(opts, link, Path(args.out), args.command)


if __name__ == "__main__":
    sys.exit(_netns_child())
