"""``dataferry demo``: the main job, end to end on the embedded store.

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

from ._common import data_server, table

__all__ = ["StreamDemoOptions", "run_stream_demo", "add_cli_arguments", "cli"]


@dataclass(frozen=True, slots=True)
class StreamDemoOptions:
    images: int = 600
    store_url: str = "sqlite:dataferry-demo.db"
    dataset: str = "demo"
    rtt_ms: float = 100.0
    epochs: int = 3
    batch_size: int = 64
    naive_seconds: float = 5.0
    progress: bool | None = None


async def _checksums(store_url: str, dataset: str) -> dict[int, str]:
    from dataferry.schema import ALL_SPLIT, open_store

    async with await open_store(store_url) as store:
        ids = (await store.read_split(dataset, ALL_SPLIT)).ids.tolist()
        metas = await store.read_meta(dataset, ids)
    return {i: m.checksum for i, m in metas.items()}


async def _naive(url: str, dataset: str, ids: list[int], seconds: float) -> tuple[int, int, float]:
    """One request per sample, one at a time, on the same link; timed from
    opening the client to the last sample, as ours is."""
    from dataferry.client import HttpSource

    n = nbytes = 0
    t0 = time.perf_counter()
    async with await HttpSource.open(url) as source:
        for i in ids:
            async for sample in source.fetch(dataset, [i]):
                nbytes += len(sample.data)
            n += 1
            if time.perf_counter() - t0 >= seconds:
                break
        return n, nbytes, time.perf_counter() - t0


def run_stream_demo(opts: StreamDemoOptions = StreamDemoOptions()) -> str:
    from dataferry.client import Loader

    from ._links import Condition, ProxyLink
    from dataferry.schema import IngestOptions, ingest, make_synthetic, open_store

    lines = []

    async def ingest_demo():
        async with await open_store(opts.store_url) as store:
            with tempfile.TemporaryDirectory(prefix="dataferry-demo-") as tmp:
                folder = os.path.join(tmp, "images")
                t0 = time.perf_counter()
                # deterministic: a second run makes the same files, and ingest finds them present
                syn = await asyncio.to_thread(make_synthetic, folder, opts.images, classes=10, seed=0)
                gen_s = time.perf_counter() - t0
                report = await ingest(store, folder, opts.dataset, IngestOptions(), progress=opts.progress)
                return syn, gen_s, report

    syn, gen_s, report = asyncio.run(ingest_demo())
    lines.append(f"generated {syn.num_images} synthetic JPEGs ({syn.total_bytes / 1e6:.1f} MB, "
                 f"mean {syn.mean_bytes / 1e3:.0f} KB) in {gen_s:.1f} s")
    lines.append(f"ingest into {opts.store_url}: {report.ingested} ingested, {report.already_present} already present, "
                 f"{len(report.rejected)} rejected"
                 + (f"; {report.images_per_s:.0f} images/s, {report.mb_per_s:.1f} MB/s" if report.ingested else ""))
    checksums = asyncio.run(_checksums(opts.store_url, opts.dataset))

    # The link is a ``dataferry latency-proxy`` process, as in the bench: in this
    # process its work would compete with the client's for the interpreter.
    with data_server(opts.store_url) as (host, port), ProxyLink().emulate(Condition(rtt_ms=opts.rtt_ms)) as route:
        proxy_host, proxy_port = route((host, port))
        link = f"http://{proxy_host}:{proxy_port}"
        lines.append(f"server http://{host}:{port}, client through a latency proxy at {opts.rtt_ms:.0f} ms RTT ({link})")
        rows = []
        total = total_bytes = 0
        t_start = time.perf_counter()
        with Loader(link, opts.dataset, batch_size=opts.batch_size) as loader:
            for epoch in range(opts.epochs):
                t0 = time.perf_counter()
                seen: Counter = Counter()
                nbytes = 0
                for batch in loader:
                    for i, data in zip(batch.ids.tolist(), batch.data):
                        if hashlib.sha256(data).hexdigest() != checksums[i]:
                            raise RuntimeError(f"sample {i} does not match its checksum")
                        seen[i] += 1
                    nbytes += batch.nbytes
                t_end = time.perf_counter()
                dt = t_end - t0
                if set(seen) != set(checksums) or max(seen.values()) != 1:
                    raise RuntimeError(f"epoch {epoch} did not deliver every sample exactly once")
                total += sum(seen.values())
                total_bytes += nbytes
                rows.append([f"dataferry, epoch {epoch} (partly prefetched)", f"{len(seen):,}",
                             f"{len(seen) / dt:,.0f}", f"{nbytes / dt / 1e6:,.1f}", f"{dt:.2f}"])
            stats = loader.stats()
        ours_s = t_end - t_start
        n, nb, dt = asyncio.run(_naive(link, opts.dataset, list(checksums), opts.naive_seconds))
    ours, naive = total / ours_s, n / dt
    head = [["dataferry (completion order, adaptive window)", f"{total:,}", f"{ours:,.0f}",
             f"{total_bytes / ours_s / 1e6:,.1f}", f"{ours_s:.3f}"],
            ["naive (1 request in flight, 1 sample each)", f"{n:,}", f"{naive:,.1f}", f"{nb / dt / 1e6:,.2f}", f"{dt:.3f}"]]
    lines.append("total samples over total wall time, from creating the loader to the last batch:")
    lines.append(table(["loader", "samples", "samples/s", "MB/s", "seconds"], head + rows))
    lines.append(f"headline: dataferry {ours:,.0f} samples/s against {naive:,.1f} samples/s naive on this link "
                 f"({ours / max(naive, 1e-9):,.0f}x); every epoch delivered each sample exactly once, checksums verified")
    lines.append(f"client: window {stats.window}, request latency {(stats.request_latency or 0) * 1e3:.0f} ms "
                 f"(min {(stats.min_latency or 0) * 1e3:.0f} ms), waited {stats.wait_fraction:.0%} of the time, "
                 f"peak {stats.peak_bytes / 2**20:.0f} MiB, retries {stats.retries}")
    return "\n".join(lines)


# --- ``dataferry demo`` (the CLI imports this module only for that command) ---


def add_cli_arguments(p: argparse.ArgumentParser) -> None:
    from dataferry.schema import positive as _positive, store_arg as _store_arg

    p.add_argument("--images", type=_positive, default=600, metavar="N", help="synthetic images (default: 600)")
    _store_arg(p, "sqlite:dataferry-demo.db")
    p.add_argument("--rtt", type=float, default=100.0, metavar="MS", help="round trip of the emulated link (default: 100)")
    p.add_argument("--epochs", type=_positive, default=3, help="epochs to stream (default: 3)")
    p.add_argument("--naive-seconds", type=float, default=5.0, metavar="S", help="how long the naive loader runs (default: 5)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def cli(args: argparse.Namespace) -> int:
    opts = StreamDemoOptions(images=args.images, store_url=args.store, rtt_ms=args.rtt, epochs=args.epochs,
                             naive_seconds=args.naive_seconds, progress=False if args.quiet else None)
    print(run_stream_demo(opts))
    return 0
