"""Defaults against the self-tuning loader against a hand-tuned grid, on two links.

``python -m dataferry.bench.tune [--seconds 3] [--runs 3] [--images 65536] [--size 110000] [--links fast,slow]``

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

__all__ = ["LINKS", "main"]

#: name -> (latency s, rate Mbit/s or None, request sizes, windows) of the hand-tuned grid
LINKS = {
    "fast": (0.0, None, (32, 64, 128, 256), (2, 4, 16, 64)),
    "slow": (0.2, 100.0, (8, 32, 128), (2, 8, 64)),
}


def main(argv: list[str] | None = None) -> int:
    from dataferry.client import Prefetch

    p = argparse.ArgumentParser(prog="python -m dataferry.bench.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="per run on the fast link (x4 on the slow one)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--images", type=int, default=65536)
    p.add_argument("--size", type=int, default=110_000, help="bytes per sample")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--links", default="fast,slow")
    args = p.parse_args(argv)
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
