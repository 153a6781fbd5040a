"""Is a training loop of a given pace kept fed over a long round trip? The byte budget that follows
the link (the default) against a fixed one, in alternated pairs.

    python -m dataferry.bench.budget [--rates 10000,25000] [--rtts 100,200] [--pairs 3]
                                     [--size 110000] [--samples 30000] [--epochs 3]
                                     [--against max_bytes=512MiB]

The source is a ``MemorySource`` whose requests each take the RTT (no bandwidth limit, no copy:
what is measured is the engine and its budget, not a network). The loop takes batches of 256 at
its own pace (``--rates``, samples/s, kept by sleeping to a schedule, as a GPU step would) and
never runs ahead of it. Per setting it prints the median over ``--pairs`` of the delivered rate
after the first batch as a share of the loop's pace (1.00: never starved), the budget reached
(``Stats.budget``), the accounting's peak (``Stats.peak_bytes``), and the seconds the budget held
requests back. What it cannot show: a real link's bandwidth, the kernel's receive copy, a decode
sharing the cores (``gpu_check --e2e`` measures those on a GPU machine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from ._common import prefetch_of, table

__all__ = ["main", "measure"]


def _samples(n: int, size: int):
    from dataferry.schema import Sample

    blobs = [bytes([k]) * size for k in range(16)]  # 16 payloads shared: large samples, little memory
    return [Sample(i, i % 10, blobs[i % 16]) for i in range(n)]


def measure(samples, rtt_s: float, rate: float, epochs: int, prefetch) -> dict:
    """One run: the loop at ``rate`` samples/s over ``epochs``; the figures of the module docstring."""
    from dataferry.client import Loader, MemorySource

    kw = {} if prefetch is None else {"prefetch": prefetch}
    with Loader(MemorySource("b", samples, latency=rtt_s), "b", batch_size=256, **kw) as loader:
        n, first, due = 0, None, 0.0
        for _ in range(epochs):
            for b in loader:
                n += len(b)
                now = time.perf_counter()
                if first is None:
                    first = due = now
                    n0 = n
                due += len(b) / rate
                if due > time.perf_counter():
                    time.sleep(due - time.perf_counter())
        end = time.perf_counter()
        s = loader.stats()
    got = (n - n0) / (end - first)
    return {"share": got / rate, "budget": s.budget, "peak": s.peak_bytes, "budget_full": s.budget_full,
            "seconds": end - first}


def main(argv: list[str] | None = None) -> int:
    from dataferry.schema import DataferryError

    ap = argparse.ArgumentParser(prog="python -m dataferry.bench.budget", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="10000,25000", help="the loop's pace, samples/s (default 10000,25000)")
    ap.add_argument("--rtts", default="100,200", help="round trips, ms (default 100,200)")
    ap.add_argument("--pairs", type=int, default=3, help="alternated pairs per cell; medians shown (default 3)")
    ap.add_argument("--size", type=int, default=110_000, help="bytes per sample (default 110000)")
    ap.add_argument("--samples", type=int, default=30_000, help="samples per epoch (default 30000)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3)")
    ap.add_argument("--against", default="max_bytes=512MiB", metavar="KEY=VALUE,...",
                    help="the Prefetch setting compared with the default (default max_bytes=512MiB, the old default)")
    args = ap.parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",")]
        rtts = [float(r) / 1e3 for r in args.rtts.split(",")]
        against = prefetch_of(args.against)
    except (ValueError, DataferryError) as exc:
        ap.error(str(exc))
    if args.pairs < 1 or args.samples < 256 or args.epochs < 1 or min(rates) <= 0 or min(rtts) < 0:
        ap.error("--pairs, --epochs >= 1, --samples >= 256, rates > 0, rtts >= 0")
    samples = _samples(args.samples, args.size)
    print(f"{args.samples} samples of {args.size:,} B x {args.epochs} epochs per run, batch 256, "
          f"{args.pairs} alternated pairs per cell; default Prefetch() against Prefetch({args.against})", flush=True)
    rows = []
    for rtt in rtts:
        for rate in rates:
            runs = {"default": [], args.against: []}
            for _ in range(args.pairs):
                runs["default"].append(measure(samples, rtt, rate, args.epochs, None))
                runs[args.against].append(measure(samples, rtt, rate, args.epochs, against))
            for name, rs in runs.items():
                med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                rows.append([f"{rtt * 1e3:g}", f"{rate:,.0f}", name, f"{med['share']:.2f}",
                             f"{min(r['share'] for r in rs):.2f}-{max(r['share'] for r in rs):.2f}",
                             f"{med['budget'] / 2**20:,.0f}", f"{med['peak'] / 2**20:,.0f}",
                             f"{med['budget_full']:.1f} of {med['seconds']:.1f}"])
                print(f"  {rtt * 1e3:g} ms, {rate:,.0f}/s, {name}: {med['share']:.2f} of the loop's pace", flush=True)
    print(table(["rtt ms", "loop samples/s", "budget", "delivered / pace (median)", "range", "budget MiB",
                 "peak MiB", "budget full s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
