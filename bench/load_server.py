"""Load test: N client processes against one data server on loopback.

    python -m dataferry.bench.load_server [--seconds 30] [--clients 8] [--images 2000]
                                          [--inflight 4] [--request-size 64] [--data synthetic|random]

The server (``python -m dataferry.server``, uvloop) serves a SQLite store of
``--images`` samples: synthetic ImageNet-like JPEGs of ~110 KB (made once and
cached in the temp folder), or with ``--data random`` random bytes of the same
sizes (instant, for smoke tests). Each client process runs its own event loop
with one :class:`HttpSource` and keeps ``--inflight`` batch requests of
``--request-size`` random ids in flight until the time is up.

Printed: samples/s and MB/s served, request latency (p50/p99), errors (must be
0: the exit status is 1 otherwise), the server's RSS idle, warm (2 s in),
middle, end and peak (flat from warm to end: about the requests in flight times
their bytes, since the store materializes a request's rows), and the server's
CPU time per sample, read from ``/proc/<pid>/stat``. Clients and server share this machine's cores, so the
numbers are a floor for the server alone.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from ._common import process_cpu_s

__all__ = ["main"]

DATASET = "bench"


# --- the store ---------------------------------------------------------------------------------
def prepare_store(images: int, data: str, folder: str | None = None) -> str:
    """A SQLite store URL holding ``images`` samples; built once per (images, data, folder)."""
    path = os.path.join(folder or tempfile.gettempdir(), f"dataferry-load-{data}-{images}.db")
    url = f"sqlite://{path}"
    asyncio.run(_fill(url, images, data))
    return url


async def _fill(url: str, images: int, data: str) -> None:
    from dataferry.schema import open_store

    async with await open_store(url) as store:
        try:
            if (await store.get_dataset(DATASET)).num_samples == images:
                return
        except LookupError:
            pass
        t0 = time.perf_counter()
        if data == "synthetic":
            from dataferry.schema import IngestOptions, ingest
            from dataferry.schema import make_synthetic

            with tempfile.TemporaryDirectory(prefix="dataferry-load-") as folder:
                make_synthetic(folder, images, classes=10, seed=0)
                await ingest(store, folder, DATASET, IngestOptions(), progress=False)
        else:
            await _fill_random(store, images)
        print(f"prepared {images} {data} samples in {time.perf_counter() - t0:.1f} s -> {url}", flush=True)


async def _fill_random(store, images: int) -> None:
    import datetime as dt

    import numpy as np

    from dataferry.schema import DatasetInfo, IdList, Sample, SampleMeta, SampleRecord

    rng = np.random.default_rng(0)
    sizes = np.clip(rng.normal(110_000, 30_000, images), 20_000, 400_000).astype(int)
    recs = []
    for i, n in enumerate(sizes.tolist()):
        blob = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        recs.append(SampleRecord(Sample(i, i % 10, blob), SampleMeta(i, i % 10, f"{i}.bin", "RAW", 1, 1, n, "0" * 64)))
    for k in range(0, images, 256):
        await store.put_samples(DATASET, recs[k : k + 256])
    names = tuple(f"class_{k:03d}" for k in range(10))
    await store.put_dataset(DatasetInfo(DATASET, names, images, dt.datetime.now(dt.timezone.utc)))
    await store.put_split(DATASET, "all", IdList(np.arange(images), np.arange(images) % 10))


# --- the server process ------------------------------------------------------------------------------
def start_server(store_url: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataferry.server", "--store", store_url, "--port", "0",
         "--no-access-log", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.split()[-1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")



# --- a client process -------------------------------------------------------------------------------------
def _client(url: str, ids: list[int], start: float, seconds: float, inflight: int, size: int, seed: int, out) -> None:
    from dataferry.schema._aio import new_event_loop

    loop = new_event_loop()
    out.put(loop.run_until_complete(_client_main(url, ids, start, seconds, inflight, size, seed)))
    loop.close()


async def _client_main(url, ids, start, seconds, inflight, size, seed) -> dict:
    from dataferry.client import HttpOptions, HttpSource

    rng = random.Random(seed)
    stats = {"samples": 0, "bytes": 0, "errors": 0, "requests": 0, "latencies": []}
    await asyncio.sleep(max(0.0, start - time.time()))
    deadline = time.monotonic() + seconds

    async def worker(src):
        while time.monotonic() < deadline:
            batch = rng.sample(ids, size)
            t0 = time.perf_counter()
            try:
                async for r in src.fetch(DATASET, batch):
                    stats["samples"] += 1
                    stats["bytes"] += len(r.data)
                stats["requests"] += 1
                stats["latencies"].append(time.perf_counter() - t0)
            except Exception as exc:  # noqa: BLE001 - counted and shown
                stats["errors"] += 1
                if stats["errors"] <= 3:
                    print(f"client error: {exc!r}", file=sys.stderr)

    async with await HttpSource.open(url, options=HttpOptions(request_size=size, connections=inflight)) as src:
        await asyncio.gather(*(worker(src) for _ in range(inflight)))
    return stats


# --- the run ---------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    store_url = prepare_store(args.images, args.data, args.cache_dir)
    ids = list(range(args.images)) if args.data == "random" else _ids(store_url)
    server, url = start_server(store_url)
    pid = server.pid
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    try:
        time.sleep(0.3)
        start = time.time() + 1.5  # clients import and connect meanwhile
        procs = [
            ctx.Process(target=_client, args=(url, ids, start, args.seconds, args.inflight, args.request_size, k, out))
            for k in range(args.clients)
        ]
        for p in procs:
            p.start()
        time.sleep(max(0.0, start - time.time()))
        rss0, cpu0, t0 = rss_mb(pid), process_cpu_s(pid), time.perf_counter()
        rss = []  # (seconds into the run, MB), every 0.25 s
        while time.perf_counter() - t0 < args.seconds:
            time.sleep(0.25)
            rss.append((time.perf_counter() - t0, rss_mb(pid)))
        results = [out.get(timeout=120) for _ in procs]
        elapsed = time.perf_counter() - t0
        cpu = process_cpu_s(pid) - cpu0
        for p in procs:
            p.join(30)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
        server.stdout.close()

    samples = sum(r["samples"] for r in results)
    nbytes = sum(r["bytes"] for r in results)
    errors = sum(r["errors"] for r in results)
    requests = sum(r["requests"] for r in results)
    lat = sorted(x for r in results for x in r["latencies"]) or [float("nan")]
    seconds = min(elapsed, args.seconds)
    print(f"load: {args.clients} client processes x {args.inflight} requests of {args.request_size} ids in flight, "
          f"{args.seconds:g} s, {args.images} {args.data} samples, {os.cpu_count()} cores shared with the clients")
    print(f"  served      {samples / seconds:10.0f} samples/s  {nbytes / seconds / 1e6:8.1f} MB/s  "
          f"({samples} samples, {requests} requests)")
    print(f"  latency     p50 {lat[len(lat) // 2] * 1e3:.1f} ms  p99 {lat[int(len(lat) * 0.99)] * 1e3:.1f} ms per request")
    print(f"  errors      {errors}")
    warm = next((mb for t, mb in rss if t >= min(2.0, args.seconds / 4)), rss0)
    mid = next((mb for t, mb in rss if t >= args.seconds / 2), rss0)
    end = rss[-1][1] if rss else rss0
    print(f"  server RSS  idle {rss0:.1f} MB  warm {warm:.1f} MB  middle {mid:.1f} MB  end {end:.1f} MB  "
          f"peak {max((mb for _, mb in rss), default=rss0):.1f} MB")
    print(f"  server CPU  {cpu:.2f} s = {cpu / max(samples, 1) * 1e6:.1f} us per sample "
          f"({cpu / seconds * 100:.0f}% of one core)")
    return 1 if errors or not samples else 0


def _ids(store_url: str) -> list[int]:
    from dataferry.schema import open_store

    async def read():
        async with await open_store(store_url) as store:
            return (await store.read_split(DATASET, "all")).ids.tolist()

    return asyncio.run(read())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataferry.bench.load_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=8, help="client processes")
    p.add_argument("--images", type=int, default=2000, help="samples in the store")
    p.add_argument("--inflight", type=int, default=4, help="requests in flight per client")
    p.add_argument("--request-size", type=int, default=64, help="ids per request")
    p.add_argument("--data", choices=("synthetic", "random"), default="synthetic",
                   help="synthetic JPEGs (cached after the first run) or random bytes of JPEG-like sizes")
    p.add_argument("--cache-dir", help="where the store file is kept (default: the temp folder)")
    args = p.parse_args(argv)
    if args.request_size > args.images:
        p.error("--request-size must not exceed --images")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
