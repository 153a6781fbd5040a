"""Render a sweep's ``summary.json`` as ``table.md`` and PNG plots.

    python -m dataferry.bench.report bench/results     # re-render from bench/results (runs.csv, summary.json)

Tables pivot one measure by loader (rows, labelled with their concurrency)
and RTT (columns) for each rate and loss: samples/s as a user sees them
(all samples over the wall time from creating the loader to the last batch),
steady-state throughput after the first batch, time to first batch,
client CPU per 1,000 samples and requests or streams in flight; one more
puts ours out of order and in order side by side. The plots draw each loader
against RTT, one colour per loader and one line style per rate and loss, on
log scales (the loaders differ by orders of magnitude). Matplotlib runs
headless (Agg).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ._common import table

__all__ = ["render_markdown", "write_plots", "MEASURES"]

#: key in a summary row -> (title, unit, format)
MEASURES = {
    "total_per_s": ("What a user sees, all samples over the wall time from creating the loader to the last batch",
                    "samples/s", lambda v: f"{v:,.0f}" if v >= 10 else f"{v:.1f}"),
    "samples_per_s": ("Throughput", "samples/s", lambda v: f"{v:,.0f}" if v >= 10 else f"{v:.1f}"),
    "first_batch_s": ("Time to first batch", "s", lambda v: f"{v:.2f}"),
    "cpu_per_1k": ("Client CPU per 1,000 samples", "CPU s", lambda v: f"{v:.2f}"),
    "inflight": ("Requests or streams in flight", "mean", lambda v: f"{v:,.0f}" if v >= 10 else f"{v:.1f}"),
}
#: the plot of each measure
PLOTS = {"total_per_s": "throughput", "first_batch_s": "first_batch", "cpu_per_1k": "cpu", "inflight": "inflight"}
#: ours in order next to ours out of order
_ORDERS = (("http-ooo", "http-inorder"), ("cql-ooo", "cql-inorder"))
#: the two throughput measures: the headline (from creating the loader) and the steady state (after the first batch)
_RATES = ("total_per_s", "samples_per_s")

_COLOURS = {"http-ooo": "#08519c", "http-inorder": "#6baed6", "http-concurrent": "#ff7f00", "http-naive": "#de2d26",
            "cql-ooo": "#006d2c", "cql-inorder": "#74c476", "cql-naive": "#fc9272", "webdataset": "#6a51a3",
            "mosaic": "#8c510a", "litdata": "#e7298a"}


def _seconds(doc: dict) -> float:
    """The steady-state window a run asks for: a shorter one means it reached ``max_samples`` (one epoch) first."""
    return doc["options"]["seconds"]


def _label(doc: dict, loader: str) -> str:
    return doc.get("labels", {}).get(loader, loader)


def _series(doc: dict) -> list[tuple[str, float]]:
    """The (rate, loss) pairs of the sweep, in sweep order."""
    seen = []
    for row in doc["summary"]:
        key = (row["rate"] or "unlimited", row["loss_pct"])
        if key not in seen:
            seen.append(key)
    return seen


def _rows(doc: dict, rate: str, loss: float) -> list[dict]:
    return [r for r in doc["summary"] if (r["rate"] or "unlimited") == rate and r["loss_pct"] == loss]


def _cell(row: dict | None, key: str, seconds: float = 0.0) -> str:
    if row is None:
        return "-"
    if row.get(key) is None:
        if row["status"] == "ok":
            return "-"  # measured, but this figure not reported
        return "n/a" if row["status"].startswith("n/a") else "failed"
    text = MEASURES[key][2](row[key])
    if key == "inflight" and (row.get("per_request") or 1) > 1.5:
        text += f" x{row['per_request']:.0f}"  # requests of several samples each
    if key in _RATES and row.get("within_epoch") is False:
        text += "*"
    if key in _RATES and row.get("window_s") is not None and row["window_s"] < seconds:
        text += "†"
    return text


def _pivot(doc: dict, key: str, rate: str, loss: float) -> str:
    rows = _rows(doc, rate, loss)
    rtts = sorted({r["rtt_ms"] for r in rows})
    by = {(r["loader"], r["rtt_ms"]): r for r in rows}
    header = ["loader", *(f"{rtt:g} ms" for rtt in rtts)]
    keep = key in _RATES and len(rtts) > 1
    if keep:
        header.append(f"{rtts[-1]:g} vs {rtts[0]:g} ms")
    body = []
    for loader in doc["loaders"]:
        if not any((loader, rtt) in by for rtt in rtts):
            continue
        line = [_label(doc, loader), *(_cell(by.get((loader, rtt)), key, _seconds(doc)) for rtt in rtts)]
        if keep:
            first, last = by.get((loader, rtts[0])), by.get((loader, rtts[-1]))
            ok = first and last and first.get(key) and last.get(key) is not None
            line.append(f"{last[key] / first[key]:.0%}" if ok else "-")
        body.append(line)
    return table(header, body)


def _orders(doc: dict, rate: str, loss: float) -> str | None:
    """Ours out of order and in order side by side, per RTT (samples/s from creating the loader)."""
    rows = _rows(doc, rate, loss)
    by = {(r["loader"], r["rtt_ms"]): r for r in rows}
    pairs = [pair for pair in _ORDERS if all(any(r["loader"] == n for r in rows) for n in pair)]
    if not pairs:
        return None
    header = ["RTT"]
    for ooo, inorder in pairs:
        header += [f"{ooo} samples/s", f"{inorder} samples/s", "in order / out of order"]
    body = []
    for rtt in sorted({r["rtt_ms"] for r in rows}):
        line = [f"{rtt:g} ms"]
        for ooo, inorder in pairs:
            a, b = by.get((ooo, rtt)), by.get((inorder, rtt))
            ok = a and b and a.get("total_per_s") and b.get("total_per_s") is not None
            line += [_cell(a, "total_per_s", _seconds(doc)), _cell(b, "total_per_s", _seconds(doc)),
                     f"{b['total_per_s'] / a['total_per_s']:.0%}" if ok else "-"]
        body.append(line)
    return table(header, body)


def render_markdown(doc: dict) -> str:
    meta, opts = doc["meta"], doc["options"]
    workers = (f"DataLoader workers: naive {opts['naive_workers']}, concurrent {opts['concurrent_workers']} x "
               f"{opts['pool']} threads, WebDataset/Streaming/LitData {opts['workers']}" if "naive_workers" in opts
               else f"DataLoader workers {opts['workers']}")
    longer = [r for r in doc["summary"] if r.get("within_epoch") is False]
    shorter = [r for r in doc["summary"] if r.get("window_s") is not None and r["window_s"] < _seconds(doc)]
    out = [
        "# `dataferry bench` results",
        "",
        f"{meta.get('date', '')}; {meta.get('machine', '')}; link: **{meta['link']}**; "
        f"{meta['images']} synthetic JPEGs of {meta['mean_kb']:.0f} KB mean ({meta['dataset_mb']:.0f} MB)"
        + (f", WebDataset in {meta['shards']} shards of {meta['shard_mb']:.0f} MB" if "shards" in meta else "")
        + f"; batch {opts['batch_size']}; {workers}. Each cell is the median of "
        f"{opts['repeats']} runs, each measured for {opts['seconds']:g} s after its first batch"
        + (", each reading at most one epoch" if opts.get("max_samples", 0) is None else "")
        + ". The first table counts what a user sees: every sample over the wall time from creating the loader to "
        "its last batch, the time to the first batch included; \"Throughput\" is the steady state after the first "
        f"batch. The sweep took {meta['total_s'] / 60:.1f} min.",
        "",
        f"Command: `{meta.get('command', '')}`" + (f" ({meta['note']})" if meta.get("note") else ""),
        "",
        *(["Through `--link proxy` a rate caps each TCP connection on its own, not the link (`--link veth` and "
           "`--link netem` cap the link).", ""] if meta["link"] == "proxy" and any(r["rate"] for r in doc["summary"])
          else []),
        *(f"- `{_label(doc, name)}`: {text}" for name, text in doc["loaders"].items()
          if any(r["loader"] == name for r in doc["summary"])),
        *(["", "In flight, per loader: " + "; ".join(f"`{name}` {basis}" for name, basis in doc["in_flight"].items())
           + ". `x N`: each request carries N samples on average."] if doc.get("in_flight") else []),
        *(["", "`*`: the run read more than one epoch's samples (a loader may have re-read what it cached)."]
          if longer else []),
        *(["", f"`†`: the run reached one epoch in less than {opts['seconds']:g} s: a short window, so its "
               "figure is rough (and a loader whose workers deliver their batches together looks faster than it is)."]
          if shorter else []),
    ]
    series = _series(doc)
    base = series[0]
    for rate, loss in series:
        measured = any(r["status"] == "ok" for r in _rows(doc, rate, loss))
        if not measured:
            why = next(r["status"] for r in _rows(doc, rate, loss))
            out += ["", f"## Rate {rate}, loss {loss:g}%", "", f"Not measured: {why.removeprefix('n/a: ')}."]
            continue
        keys = list(MEASURES) if (rate, loss) == base else list(_RATES)
        for key in keys:
            title, unit, _ = MEASURES[key]
            out += ["", f"## {title} ({unit}): rate {rate}, loss {loss:g}%", "", _pivot(doc, key, rate, loss)]
            orders = _orders(doc, rate, loss) if key == "total_per_s" else None
            if orders:
                out += ["", f"## Out of order and in order (samples/s): rate {rate}, loss {loss:g}%", "", orders]
    return "\n".join(out) + "\n"


def write_plots(doc: dict, out: Path) -> list[Path]:
    """throughput.png, first_batch.png, cpu.png and inflight.png under ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    styles = ["-", "--", ":", "-."]
    series = [s for s in _series(doc) if any(r["status"] == "ok" for r in _rows(doc, *s))]
    meta = doc["meta"]
    paths = []
    for key, name in PLOTS.items():
        title, unit, _ = MEASURES[key]
        fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=100)
        loaders = []
        for (rate, loss), style in zip(series, styles):
            rows = _rows(doc, rate, loss)
            for loader in doc["loaders"]:
                points = sorted((r["rtt_ms"], r[key]) for r in rows
                                if r["loader"] == loader and r.get(key) is not None)
                if not points:
                    continue
                if loader not in loaders:
                    loaders.append(loader)
                xs, ys = zip(*points)
                ax.plot(xs, ys, style, marker="o", markersize=3.5, linewidth=1.6, color=_COLOURS.get(loader))
        ax.set_yscale("log")
        ax.set_xlabel("round-trip time, ms")
        ax.set_ylabel(unit)
        rtts = sorted({r["rtt_ms"] for r in doc["summary"]})
        ax.set_xticks(rtts)
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(f"{title}, {meta['images']} images of {meta['mean_kb']:.0f} KB, link: {meta['link']}", fontsize=10)
        handles = [Line2D([], [], color=_COLOURS.get(n), marker="o", markersize=3.5, label=_label(doc, n))
                   for n in loaders]
        if len(series) > 1:
            handles += [Line2D([], [], color="grey", linestyle=st, label=f"{rate}, loss {loss:g}%")
                        for (rate, loss), st in zip(series, styles)]
        ax.legend(handles=handles, fontsize=7.5, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dataferry.bench.report RESULTS_DIR", file=sys.stderr)
        return 2
    out = Path(args[0])
    doc = json.loads((out / "summary.json").read_text())
    if (out / "runs.csv").exists():  # the medians are made again from every run, with any measure added since
        from .sweep import read_runs, summarize

        doc["summary"] = summarize(read_runs(out / "runs.csv"), doc["meta"]["images"])
        (out / "summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "table.md").write_text(render_markdown(doc))
    write_plots(doc, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
