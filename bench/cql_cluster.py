"""A Cassandra 5.0 cluster behind dataferry: ingest into it, and the data service over it.

``python -m dataferry.bench.cql_cluster [--nodes 3] [--images 2048] [--repeats 3] [--rtts 0,100]
[--batch-size 256] [--workers 2] [--parts ingest,serve]``

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from ._common import data_server, loader_epoch, process_cpu_s, table

__all__ = ["main"]

DATASET = "bench"


@dataclass(frozen=True, slots=True)
class Store:
    """One of the bench's stores: its name in the tables, its nodes and their replication factor."""

    name: str
    cluster: object  # a started DevCluster
    replicas: int

    def url(self, keyspace: str) -> str:
        return self.cluster.url(keyspace)

    def cpu_s(self) -> float:
        """CPU seconds used so far by every node's JVM."""
        return sum(process_cpu_s(node.pid) for node in self.cluster.nodes)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dataferry.schema.cli", *args], capture_output=True, text=True,
                          check=False, stdin=subprocess.DEVNULL)


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def ingest_once(store: Store, keyspace: str, folder: str, images: int, nbytes: int) -> dict:
    """``dataferry ingest`` of ``folder`` into a new keyspace of ``store``, timed end to end."""
    url = store.url(keyspace)
    applied = _cli("schema", "apply", "--store", url, "--replication", f"SimpleStrategy:{store.replicas}")
    if applied.returncode != 0:
        raise RuntimeError(f"schema apply on {url} failed: {applied.stderr.strip()[-2000:]}")
    n0, c0, t0 = store.cpu_s(), _children_cpu_s(), time.perf_counter()
    done = _cli("ingest", folder, "--dataset", DATASET, "--store", url, "--quiet")
    wall, cpu, nodes = time.perf_counter() - t0, _children_cpu_s() - c0, store.cpu_s() - n0
    if done.returncode != 0:  # a failed run is a result: counted, and finished (untimed) for the service
        error = (done.stdout + done.stderr).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        for _ in range(3):
            if _cli("ingest", folder, "--dataset", DATASET, "--store", url, "--quiet").returncode == 0:
                return {"failed": error[0]}
        raise RuntimeError(f"dataferry ingest into {url} failed 4 times; the first: {error[0]}")
    return {"wall_s": wall, "per_s": images / wall, "mb_s": nbytes / wall / 1e6,
            "cpu_us": cpu / images * 1e6, "nodes_us": nodes / images * 1e6,
            "summary": done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""}


def _consistency(url: str) -> str:
    """The consistency the store chose for ``url`` (its default: from the keyspace's replication)."""
    from dataferry.schema import open_store

    async def ask():
        async with await open_store(url, create=False) as store:
            return store.consistency

    return asyncio.run(ask())


def _run_child(url: str, batch_size: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "dataferry.bench.cql_cluster", "--child", url,
                          "--batch-size", str(batch_size)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"measuring run failed (exit {out.returncode}): {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def serve_once(store: Store, server, url: str, batch_size: int) -> dict:
    """One epoch of a Loader on ``url`` (the service, across the link) in a fresh process; with the
    server's and the nodes' CPU over the same span."""
    s0, n0 = process_cpu_s(server.pid), store.cpu_s()
    r = _run_child(url, batch_size)
    served = max(r["served"], 1.0)
    r["server_us"] = (process_cpu_s(server.pid) - s0) / served * 1e6
    r["nodes_us"] = (store.cpu_s() - n0) / served * 1e6
    return r


def _idle_cpu(store: Store, seconds: float = 5.0) -> float:
    """Milliseconds of CPU per second the store's nodes use with nothing asked of them (gossip,
    compaction of the ingests): part of every run's nodes' figure."""
    n0, t0 = store.cpu_s(), time.perf_counter()
    time.sleep(seconds)
    return (store.cpu_s() - n0) / (time.perf_counter() - t0) * 1e3


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def run(args: argparse.Namespace) -> list[str]:
    """The bench (see the module docs); the printed report's lines."""
    from dataferry.schema import make_synthetic

    from ._devcassandra import DevCluster
    from ._links import Condition, ProxyLink

    rtts = [float(x) for x in args.rtts.split(",") if x.strip()]
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    out = [f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="dataferry-bench-"))
        t0 = time.perf_counter()
        cluster = stack.enter_context(DevCluster(args.nodes, os.path.join(tmp, "cluster")))
        single = stack.enter_context(DevCluster(1, os.path.join(tmp, "single"), first_address=args.nodes + 1))
        stores = [Store(f"{args.nodes} nodes, RF {args.nodes}", cluster, args.nodes), Store("1 node, RF 1", single, 1)]
        synthetic = make_synthetic(os.path.join(tmp, "images"), args.images, classes=10, seed=0)
        _log(f"cql_cluster: {cluster!r} and {single!r} up in {time.perf_counter() - t0:.0f} s; {args.images} images "
             f"of {synthetic.mean_bytes / 1e3:.0f} KB mean")

        ingested: dict[str, list[dict]] = {}
        failed: dict[str, list[str]] = {}  # per store, the error of each failed ingest run
        keyspace: dict[str, str] = {}  # per store, the keyspace the service reads
        for repeat in range(args.repeats if "ingest" in parts else 1):
            for store in stores:
                ks = f"ingest_rf{store.replicas}_{repeat + 1}"
                r = ingest_once(store, ks, synthetic.root, args.images, synthetic.total_bytes)
                keyspace.setdefault(store.name, ks)
                if "ingest" in parts and "failed" in r:
                    failed.setdefault(store.name, []).append(r["failed"])
                    _log(f"  ingest into {store.name:<16} run {repeat + 1}: FAILED ({r['failed']}); run again to finish")
                elif "ingest" in parts:
                    ingested.setdefault(store.name, []).append(r)
                    _log(f"  ingest into {store.name:<16} run {repeat + 1}: {r['wall_s']:.1f} s, "
                         f"{r['per_s']:,.0f} samples/s, {r['mb_s']:.1f} MB/s, ingest {r['cpu_us']:,.0f} us CPU/sample, "
                         f"nodes {r['nodes_us']:,.0f} us/sample ({r['summary']})")
        consistency = {s.name: _consistency(s.url(keyspace[s.name])) for s in stores}
        if "ingest" in parts:
            rows = [[s.name, consistency[s.name], f"{len(failed.get(s.name, ()))} of {args.repeats}",
                     *(f"{_med(runs, k):{f}}" if runs else "-" for k, f in (
                         ("wall_s", ".1f"), ("per_s", ",.0f"), ("mb_s", ".1f"), ("cpu_us", ",.0f"), ("nodes_us", ",.0f")))]
                    for s in stores for runs in [ingested.get(s.name, [])]]
            out += [f"\ningest: dataferry ingest of {args.images} synthetic JPEGs ({synthetic.total_bytes / 1e6:.0f} MB), "
                    f"median of the runs that did not fail",
                    table(["store", "consistency", "failed runs", "wall s", "samples/s", "MB/s", "ingest CPU us/sample",
                           "nodes' CPU us/sample"], rows)]
            out += [f"  failed into {name}: {error}" for name, errors in failed.items() for error in errors]

        if "serve" in parts:
            idle = {s.name: _idle_cpu(s) for s in stores}
            out.append("\nthe nodes idle (before the service starts): " + ", ".join(
                f"{name} {ms:.0f} ms CPU/s" for name, ms in idle.items()))
            served: dict[tuple[str, float], list[dict]] = {}
            servers = {s.name: stack.enter_context(data_server(s.url(keyspace[s.name]),
                                                               args=("--workers", str(args.workers))))
                       for s in stores}
            link = ProxyLink()
            routes = {rtt: stack.enter_context(link.emulate(Condition(rtt_ms=rtt))) for rtt in rtts}
            for repeat in range(args.repeats):
                for store in stores:
                    for rtt, route in routes.items():
                        host, port = route(servers[store.name])
                        r = serve_once(store, servers[store.name], f"http://{host}:{port}", args.batch_size)
                        served.setdefault((store.name, rtt), []).append(r)
                        _log(f"  serve over {store.name:<16} {rtt:>4g} ms run {repeat + 1}: first batch "
                             f"{r['first_batch_s']:.3f} s, {r['total_per_s']:,.0f} samples/s from creating the Loader, "
                             f"client {r['cpu_us_per_sample']:.1f} us/sample, server {r['server_us']:.1f}, "
                             f"nodes {r['nodes_us']:.1f}; {r['requests']} requests, {r['retries']} retried, "
                             f"{r['hedges']} hedged, {r['failures']} failed")
            rows = []
            for (name, rtt), runs in served.items():
                base = served.get((name, 0.0))
                ratio = statistics.median(r["total_per_s"] / b["total_per_s"] for r, b in zip(runs, base)) if base else None
                rows.append([name, f"{rtt:g} ms", f"{_med(runs, 'first_batch_s'):.3f}", f"{_med(runs, 'total_per_s'):,.0f}",
                             "-" if ratio is None else f"{ratio:.2f}", f"{_med(runs, 'samples_per_s'):,.0f}",
                             f"{_med(runs, 'cpu_us_per_sample'):.1f}", f"{_med(runs, 'server_us'):.1f}",
                             f"{_med(runs, 'nodes_us'):.1f}", f"{_med(runs, 'mean_inflight'):.1f}",
                             f"{_med(runs, 'latency_ms'):.0f}"])
            out += [f"\nserve: dataferry serve --workers {args.workers}, a Loader over HTTP through the latency proxy, "
                    f"one epoch of {args.images} per run, batch {args.batch_size}, median of {args.repeats} runs",
                    table(["store", "RTT", "first batch s", "samples/s from creating the Loader", "of 0 ms",
                           "samples/s after the first batch", "client CPU us/sample", "server CPU us/sample served",
                           "nodes' CPU us/sample served", "mean in flight", "request latency ms"], rows)]
    out.append(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return out


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataferry.bench.cql_cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=3, help="nodes of the cluster (and its replication factor)")
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rtts", default="0,100", help="RTTs in ms through the latency proxy, comma-separated")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2, help="dataferry serve --workers")
    p.add_argument("--parts", default="ingest,serve", help="ingest, serve or both")
    p.add_argument("--child", metavar="URL", help=argparse.SUPPRESS)  # one measuring run, JSON on stdout
    args = p.parse_args(argv)
    if args.child:
        r = loader_epoch(args.child, DATASET, args.batch_size)
        print(json.dumps({k: v for k, v in r.items() if k not in ("t0", "t1")}))
        return 0
    if not {x.strip() for x in args.parts.split(",") if x.strip()} <= {"ingest", "serve"} or not args.parts.strip():
        p.error(f"--parts: {args.parts!r}: name ingest, serve or both")
    if not 2 <= args.nodes <= 8:
        p.error("--nodes: 2 to 8 (one more node runs beside them for comparison)")
    print("\n".join(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
