"""Throughput against round-trip time, through the latency proxy.

    python -m dataferry.bench.latency [--images 1000] [--rtt 0,20,100,200] [--seconds 5] [--repeats 3]

For each RTT a :class:`~dataferry.client.ProxyThread` delays every byte by
RTT/2 each way, and each loader reads the same dataset through it. The CQL
path puts the proxy in front of Cassandra; the HTTP path puts it in front of
the data service, which sits next to its store (SQLite by default, like a
server on the storage host; ``--http-store cassandra`` reads the Cassandra
store instead).

* ``cql-ooo`` / ``http-ooo``: the engine, out of order, incremental window;
* ``cql-inorder`` / ``http-inorder``: the engine with ``order="input"``;
* ``cql-naive`` / ``http-naive``: a torch DataLoader, 2 workers, one
  blocking request per sample.

Each configuration runs ``--repeats`` times; the table shows medians of
steady-state throughput (after the first batch), time to first batch, and
client CPU per 1,000 samples, plus each loader at each RTT as a share of the
same loader at the first RTT. ``http-ooo`` is also measured straight on
loopback without the proxy (RTT ``lo``).
"""

from __future__ import annotations

import argparse
import sys

from ._common import Measurement, all_ids, data_server, measure_loader, median_of, prepared_store, table
from ._loaders import NaiveCqlDataset, NaiveHttpDataset, naive, ours, with_options

__all__ = ["main", "run"]


def _measure(results, name: str, rtt, make, args) -> None:
    runs = [measure_loader(make, seconds=args.seconds, max_samples=args.max_samples) for _ in range(args.repeats)]
    results[name, rtt] = m = median_of(runs)
    print(f"rtt {rtt!s:>5} ms  {name:<13} {m.samples_per_s:>9,.0f} samples/s {m.mb_per_s:>8,.1f} MB/s "
          f"first batch {m.first_batch:.2f}s  cpu {m.cpu_per_1k:.2f}s/1k", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import contextlib

    from dataferry.client import LinkOptions, ProxyThread

    rtts = [float(x) for x in args.rtt.split(",")]
    loaders = args.loaders.split(",")
    cql = [n for n in loaders if n.startswith("cql-")]
    web = [n for n in loaders if n.startswith("http-")]
    results: dict[tuple[str, object], Measurement] = {}
    with contextlib.ExitStack() as stack:
        url, upstream, report = stack.enter_context(prepared_store("cassandra", args.images, store_url=args.store))
        print(f"dataset: {report.num_samples} images, {report.bytes_out / max(report.num_samples, 1) / 1e3:.0f} KB "
              f"mean (Cassandra at {upstream[0]}:{upstream[1]})", file=sys.stderr)
        ids = all_ids(url)
        server = None
        if web:
            http_store = url if args.http_store == "cassandra" else stack.enter_context(
                prepared_store("sqlite", args.images))[0]
            server = stack.enter_context(data_server(http_store))
            if "http-ooo" in web:
                make = ours(f"http://{server[0]}:{server[1]}", "bench", order="completion",
                             batch_size=args.batch_size, inflight=args.inflight)
                _measure(results, "http-ooo", "lo", make, args)
        for rtt in rtts:
            link = LinkOptions(delay=rtt / 2000)
            if cql:
                with ProxyThread(upstream, link) as proxy:
                    via = with_options(url, *proxy.address, concurrency=args.concurrency, request_timeout=30)
                    for name in cql:
                        if name == "cql-naive":
                            make = naive(NaiveCqlDataset(via, "bench", ids), batch_size=args.batch_size)
                        else:
                            make = ours(via, "bench", order="input" if name == "cql-inorder" else "completion",
                                         batch_size=args.batch_size, inflight=args.inflight)
                        _measure(results, name, rtt, make, args)
            if web:
                with ProxyThread(server, link) as proxy:
                    for name in web:
                        if name == "http-naive":
                            make = naive(NaiveHttpDataset(proxy.address, "bench", ids), batch_size=args.batch_size)
                        else:
                            make = ours(f"http://{proxy.address[0]}:{proxy.address[1]}", "bench",
                                         order="input" if name == "http-inorder" else "completion",
                                         batch_size=args.batch_size, inflight=args.inflight)
                        _measure(results, name, rtt, make, args)
    print(render(results, rtts, loaders))
    return 0


def render(results, rtts, loaders) -> str:
    rows = []
    for name in loaders:
        base = results.get((name, rtts[0]))
        for rtt in (["lo"] if (name, "lo") in results else []) + rtts:
            m = results[name, rtt]
            share = f"{m.samples_per_s / base.samples_per_s:.0%}" if base and base.samples_per_s and rtt != "lo" else "-"
            label = "loopback" if rtt == "lo" else f"{rtt:.0f}"
            rows.append([name, label, f"{m.samples_per_s:,.0f}", f"{m.mb_per_s:,.1f}", share,
                         f"{m.first_batch:.2f}", f"{m.cpu_per_1k:.2f}"])
    return table(["loader", "RTT ms", "samples/s", "MB/s", f"vs RTT {rtts[0]:.0f}", "first batch s", "CPU s/1k"], rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=1000, help="synthetic ~110 KB JPEGs (default 1000)")
    p.add_argument("--rtt", default="0,20,100,200", help="round-trip times in ms (default 0,20,100,200)")
    p.add_argument("--loaders", default="cql-ooo,cql-inorder,cql-naive,http-ooo,http-inorder,http-naive")
    p.add_argument("--http-store", choices=("sqlite", "cassandra"), default="sqlite",
                   help="the store behind the data service (default sqlite, on the server's host)")
    p.add_argument("--seconds", type=float, default=5.0, help="steady-state seconds per run (default 5)")
    p.add_argument("--max-samples", type=int, default=50_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--inflight", type=int, default=64, help="engine max requests in flight")
    p.add_argument("--concurrency", type=int, default=768, help="CQL requests in flight per store")
    p.add_argument("--store", default=None, help="an existing cassandra:// store (default: start Cassandra 1.2)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataferry.bench.latency", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
