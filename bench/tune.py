"""Defaults against the self-tuning loader against a hand-tuned grid, on two links.

``python -m dataferry.bench.tune [--seconds 3] [--runs 3] [--images 65536] [--size 110000] [--links fast,slow]``
``python -m dataferry.bench.tune --http [--rtts 0,100,200] [--pairs 3] [--seconds 3] [--proxy-window 4MiB] [--control]``:
a real ``dataferry serve --workers 2`` behind a latency proxy, the default against the best hand-tuned
(``--control``: and the best against itself, what one setting's pairs read on this machine).

The links (``--links``):

* ``fast``: 0 ms, unlimited: the engine's own CPU is the limit;
* ``slow``: 200 ms round trip at 100 Mbit/s, one bottleneck shared by every
  request in flight.

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import argparse
import statistics

from ._common import table
from .window import make_source, median_run, run_once

__all__ = ["HTTP_GRID", "LINKS", "main"]

#: name -> (latency s, rate Mbit/s or None, request sizes, windows) of the hand-tuned grid
LINKS = {
    "fast": (0.0, None, (32, 64, 128, 256), (2, 4, 16, 64)),
    "slow": (0.2, 100.0, (8, 32, 128), (2, 8, 64)),
}


#: --http: the hand-tuned Prefetch settings tried against the default at every round trip
HTTP_GRID = ("request_size=32", "request_size=64", "request_size=128",
             "tune=false,request_size=64,max_inflight=8", "tune=false,request_size=64,max_inflight=32",
             "tune=false,request_size=128,max_inflight=16")


def http_main(args) -> int:
    """The held-out-style set-up: a real ``dataferry serve --workers 2`` on a SQLite store, a
    latency-proxy process per round trip, this client: all on this machine's cores. Each round trip:
    one run of every hand-tuned setting (the best is kept), then ``--pairs`` alternated pairs of
    the default (``Prefetch()``) and that best, in alternating order."""
    from ._common import data_server, prefetch_of, prepared_store, process_cpu_s
    from ._links import Condition, ProxyLink

    rtts = [float(x) for x in args.rtts.split(",")]
    summary = []
    with prepared_store("sqlite", args.store_images) as (store_url, _, _), \
            data_server(store_url, args=("--workers", "2")) as address:
        def run(url: str, setting: str, seconds: float):
            s0 = process_cpu_s(address.pid)
            r = run_once(lambda: url, prefetch_of(setting), seconds=seconds, batch_size=args.batch_size)
            return r, (process_cpu_s(address.pid) - s0) / max(r.samples, 1) * 1e6

        for rtt in rtts:
            seconds = args.seconds * (1 if rtt == 0 else 2)
            with ProxyLink(window=args.proxy_window).emulate(Condition(rtt)) as route:
                host, port = route(address)
                url = f"http://{host}:{port}"
                run(url, "default", 1.0)  # warm the server's page cache and the proxy
                grid = {s: run(url, s, seconds) for s in HTTP_GRID}
                best = max(grid, key=lambda s: grid[s][0].samples_per_s)
                pairs = []
                for i in range(args.pairs):
                    order = ("default", best) if i % 2 == 0 else (best, "default")
                    got = {s: run(url, s, seconds) for s in order}
                    pairs.append((got["default"], got[best]))
                # the control: the same setting twice, what a pair reads when nothing differs
                control = [(run(url, best, seconds)[0], run(url, best, seconds)[0]) for _ in range(args.pairs * args.control)]
            ratios = [d[0].samples_per_s / b[0].samples_per_s for d, b in pairs]
            print(f"\n{rtt:g} ms RTT (latency proxy, window {args.proxy_window or 'tcp_rmem max'}), serve --workers 2, "
                  f"{args.store_images} JPEGs in SQLite, batch {args.batch_size}, runs of {seconds:g} s; grid (one run each):")
            print(table(["setting", "samples/s", "client us/sample", "server us/sample", "window", "ids/req"],
                        [[s, f"{r.samples_per_s:,.0f}", f"{r.us_per_sample:.1f}", f"{srv:.1f}", str(r.window),
                          str(r.request_size)] for s, (r, srv) in grid.items()]))
            print(f"alternated pairs, default against the best hand-tuned ({best}):")
            print(table(["pair", "default /s", "best /s", "ratio", "default client+server us/sample",
                         "best client+server us/sample", "default window x ids"],
                        [[str(i + 1), f"{d.samples_per_s:,.0f}", f"{b.samples_per_s:,.0f}",
                          f"{d.samples_per_s / b.samples_per_s:.2f}", f"{d.us_per_sample:.0f}+{ds:.0f}",
                          f"{b.us_per_sample:.0f}+{bs:.0f}", f"{d.window} x {d.request_size}"]
                         for i, ((d, ds), (b, bs)) in enumerate(pairs)]))
            summary.append(f"{rtt:g} ms: default / best hand-tuned ({best}) {_read(ratios, 'alternated pairs')}")
            if control:
                same = [a.samples_per_s / b.samples_per_s for a, b in control]
                print(f"control, {best} against itself (first run / second):")
                print(table(["pair", "first /s", "second /s", "ratio"],
                            [[str(i + 1), f"{a.samples_per_s:,.0f}", f"{b.samples_per_s:,.0f}", f"{r:.2f}"]
                             for i, ((a, b), r) in enumerate(zip(control, same))]))
                summary.append(f"{rtt:g} ms: control, the best against itself: {_read(same, 'pairs')}")
    print("\n" + "\n".join(summary))
    return 0


def _read(ratios: list[float], pairs: str) -> str:
    """A summary line's figures: median, range and the pairs within 10% of ``ratios``."""
    return (f"median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f} over "
            f"{len(ratios)} {pairs}, {_within(ratios)}")


def _within(ratios: list[float], share: float = 0.10) -> str:
    """How many pairs read within ``share``: the first at least ``1 - share`` of the second."""
    return f"within {share:.0%} in {sum(r >= 1 - share for r in ratios)} of {len(ratios)}"


def main(argv: list[str] | None = None) -> int:
    from dataferry.client import Prefetch

    p = argparse.ArgumentParser(prog="python -m dataferry.bench.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="per run on the fast link (x4 on the slow one)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--images", type=int, default=65536)
    p.add_argument("--size", type=int, default=110_000, help="bytes per sample")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--links", default="fast,slow")
    p.add_argument("--http", action="store_true",
                   help="the held-out-style set-up instead: dataferry serve --workers 2 behind a latency proxy")
    p.add_argument("--rtts", default="0,100,200", help="--http: round trips in ms")
    p.add_argument("--pairs", type=int, default=3, help="--http: alternated pairs per round trip")
    p.add_argument("--store-images", type=int, default=4096, help="--http: JPEGs in the SQLite store")
    p.add_argument("--control", type=int, nargs="?", const=1, default=0, metavar="K",
                   help="--http: also K x --pairs pairs of the best against itself (default K 1): the noise "
                        "a pair of one setting reads, against which the default's pairs are judged")
    p.add_argument("--proxy-window", metavar="BYTES",
                   help="--http: the latency proxy's TCP window per connection and direction, e.g. 4MiB (a "
                        "sender's tcp_wmem maximum) or none (default: the proxy's, this kernel's tcp_rmem maximum)")
    args = p.parse_args(argv)
    if args.http:
        return http_main(args)
    summary = []
    for name in args.links.split(","):
        latency, rate, sizes, windows = LINKS[name]
        seconds = args.seconds * (4 if rate else 1)
        make = make_source(args.images, args.size, latency, rate)
        configs = {"defaults": Prefetch(tune=False), "tuned": Prefetch()}
        for r in sizes:
            for w in windows:
                configs[f"R={r} W={w}"] = Prefetch(tune=False, request_size=r, max_inflight=w,
                                                   initial_inflight=min(2, w))
        got: dict[str, list] = {k: [] for k in configs}
        for _ in range(args.runs):
            for key, prefetch in configs.items():
                got[key].append(run_once(make, prefetch, seconds=seconds, batch_size=args.batch_size))
        rates = {k: statistics.median(r.samples_per_s for r in runs) for k, runs in got.items()}
        grid = {k: v for k, v in rates.items() if k.startswith("R=")}
        best = max(grid, key=grid.get)
        print(f"\nlink {name}: {latency * 1e3:g} ms, {f'{rate:g} Mbit/s' if rate else 'unlimited'}; "
              f"{args.images} samples of {args.size} B, batch {args.batch_size}, {args.runs} runs of {seconds:g} s")
        rows = []
        for key in ("defaults", "tuned", best):
            runs = got[key]
            med = median_run(runs)
            rows.append([key if key != best else f"best hand-tuned ({key})", f"{rates[key]:,.0f}",
                         f"{rates[key] / rates[best]:.2f}",
                         f"{statistics.median(r.first_batch for r in runs):.3f}",
                         f"{statistics.median(r.us_per_sample for r in runs):.1f}",
                         str(med.window), str(med.request_size)])
        print(table(["setting", "samples/s", "/ best", "first batch s", "us/sample", "window", "ids/req"], rows))
        cpu = {k: statistics.median(r.us_per_sample for r in runs) for k, runs in got.items()}
        print("grid (samples/s, us of CPU per sample; rows R ids per request, columns W max_inflight):")
        print(table(["R \\ W", *map(str, windows)],
                    [[str(r), *(f"{rates[f'R={r} W={w}']:,.0f}, {cpu[f'R={r} W={w}']:.1f}" for w in windows)]
                     for r in sizes]))
        leanest = min((k for k in cpu if k.startswith("R=")), key=cpu.get)
        summary.append(f"{name}: tuned {rates['tuned']:,.0f}/s = {rates['tuned'] / rates[best]:.2f} x best "
                       f"hand-tuned ({best}, {rates[best]:,.0f}/s); defaults {rates['defaults'] / rates[best]:.2f} x; "
                       f"CPU per sample: tuned {cpu['tuned']:.1f} us, defaults {cpu['defaults']:.1f}, "
                       f"leanest hand-tuned {cpu[leanest]:.1f} ({leanest})")
    print("\n" + "\n".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
