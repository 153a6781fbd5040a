"""Load test: the data server alone, under a load generator that costs it little.

    python -m dataferry.bench.load_server [--workers 1,2] [--repeats 3] [--seconds 10] [--images 2000]
                                          [--clients 1] [--connections 8] [--depth 2] [--request-size 64]
                                          [--data synthetic|random]

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import re
import selectors
import socket
import statistics
import sys
import tempfile
import time

from ._common import data_server, process_cpu_s, process_tree

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


def _ids(store_url: str) -> list[int]:
    from dataferry.schema import open_store

    async def read():
        async with await open_store(store_url) as store:
            return (await store.read_split(DATASET, "all")).ids.tolist()

    return asyncio.run(read())


# --- the server process ------------------------------------------------------------------------------
def rss_mb(pids: list[int]) -> tuple[float, float]:
    """The sums over ``pids`` of ``VmRSS`` (all resident pages) and ``RssAnon``
    (the heap's: a served SQLite file's mapped pages are ``RssFile``, the page
    cache's) from one read of each ``/proc/PID/status``, in MB."""
    rss = anon = 0.0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as fh:
                kb = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in fh)
                      if k in ("VmRSS", "RssAnon")}
        except OSError:
            continue
        rss += kb.get("VmRSS", 0) / 1024
        anon += kb.get("RssAnon", 0) / 1024
    return rss, anon


# --- the load generator ----------------------------------------------------------------------------------
def _requests(host: str, ids: list[int], size: int, count: int, seed: int) -> list[bytes]:
    """``count`` ready-made batch requests of ``size`` random ids each."""
    import numpy as np

    rng = random.Random(seed)
    head = (f"POST /v1/datasets/{DATASET}/samples HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {8 * size}\r\n\r\n").encode()
    return [head + np.asarray(rng.sample(ids, size), dtype="<i8").tobytes() for _ in range(count)]


class _Conn:
    """One keep-alive connection with ``depth`` pipelined requests; parses only
    the status line and the chunked framing, and discards the bodies."""

    __slots__ = ("sock", "pending", "skip", "state", "line", "done", "errors", "bytes", "first_error")

    HEAD, SIZE = 0, 1

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.skip = 0  # body bytes still to discard
        self.state = self.HEAD
        self.line = bytearray()  # a header block or size line cut by a recv
        self.done = 0  # responses complete
        self.errors = 0
        self.bytes = 0
        self.first_error = ""

    def feed(self, buf: bytearray, n: int) -> int:
        """Parse ``buf[:n]``; the number of responses it completed."""
        completed = 0
        pos = 0
        self.bytes += n
        while pos < n:
            if self.skip:
                take = min(self.skip, n - pos)
                self.skip -= take
                pos += take
                if self.skip == 0 and self.state == self.HEAD:
                    completed += 1  # the CRLF after the last chunk
                continue
            term = b"\r\n\r\n" if self.state == self.HEAD else b"\r\n"
            if self.line:
                old = len(self.line)
                self.line += buf[pos : min(n, pos + 1024)]
                end = self.line.find(term)
                if end < 0:
                    pos += len(self.line) - old
                    continue
                pos += end + len(term) - old
                text = bytes(self.line[:end])
                self.line.clear()
            else:
                end = buf.find(term, pos, n)
                if end < 0:
                    self.line += buf[pos:n]
                    break
                text = bytes(buf[pos:end])
                pos = end + len(term)
            if self.state == self.HEAD:
                if not text.startswith(b"HTTP/1.1 200"):
                    self.errors += 1
                    self.first_error = self.first_error or text.split(b"\r\n", 1)[0].decode("latin-1")
                    # a JSON error has a Content-Length body
                    length = re.search(rb"(?i)content-length:\s*(\d+)", text)
                    self.skip = int(length.group(1)) if length else 0
                    completed += self.skip == 0
                    continue
                self.state = self.SIZE
            else:
                size = int(text.split(b";", 1)[0], 16)
                if size == 0:
                    self.state = self.HEAD
                    self.skip = 2  # the empty trailer line
                else:
                    self.skip = size + 2
        return completed


def _client(host: str, port: int, ids: list[int], size: int, connections: int, depth: int, start: float,
            warmup: float, seconds: float, seed: int, out) -> None:
    reqs = _requests(host, ids, size, 512, seed)
    rng = random.Random(seed)
    sel = selectors.DefaultSelector()
    conns = []
    for _ in range(connections):
        s = socket.create_connection((host, port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c = _Conn(s)
        conns.append(c)
        sel.register(s, selectors.EVENT_READ, c)
    buf = bytearray(1 << 20)
    time.sleep(max(0.0, start - time.time()))
    for c in conns:
        c.sock.sendall(b"".join(rng.choice(reqs) for _ in range(depth)))
    t_begin, t_end = time.time() + warmup, time.time() + warmup + seconds
    counted = None
    cpu0 = 0.0
    while True:
        now = time.time()
        if counted is None and now >= t_begin:
            counted = sum(c.done for c in conns)
            cpu0 = time.process_time()
        if now >= t_end:
            break
        for key, _ in sel.select(timeout=0.05):
            c = key.data
            n = c.sock.recv_into(buf)
            if n == 0:
                raise SystemExit("the server closed a connection")
            k = c.feed(buf, n)
            if k:
                c.done += k
                c.sock.sendall(b"".join(rng.choice(reqs) for _ in range(k)))
    cpu = time.process_time() - cpu0
    responses = sum(c.done for c in conns) - (counted or 0)
    out.put({"responses": responses, "samples": responses * size, "errors": sum(c.errors for c in conns),
             "first_error": next((c.first_error for c in conns if c.first_error), ""),
             "client_cpu": cpu, "bytes": sum(c.bytes for c in conns)})
    for c in conns:
        c.sock.close()


# --- a run -------------------------------------------------------------------------------------------------------
def run_once(args: argparse.Namespace, store_url: str, ids: list[int], workers: int | None, seed: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with data_server(store_url, args=() if workers is None else ("--workers", str(workers))) as server:
        host, port = server
        time.sleep(0.5)
        pids = process_tree(server.pid)
        start = time.time() + 1.0  # the clients import and connect meanwhile
        procs = [ctx.Process(target=_client, args=(host, port, ids, args.request_size, args.connections, args.depth,
                                                   start, args.warmup, args.seconds, seed * 100 + k, out))
                 for k in range(args.clients)]
        for p in procs:
            p.start()
        time.sleep(max(0.0, start + args.warmup - time.time()))
        cpu0, t0 = process_cpu_s(server.pid), time.perf_counter()
        time.sleep(max(0.0, start + args.warmup + args.seconds - time.time()))
        cpu, elapsed = process_cpu_s(server.pid) - cpu0, time.perf_counter() - t0
        rss, anon = rss_mb(pids)
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
    samples = sum(r["samples"] for r in results)
    return {
        "workers": workers, "samples_s": samples / elapsed, "mb_s": sum(r["bytes"] for r in results) / elapsed / 1e6,
        "cpu_us": cpu / max(samples, 1) * 1e6, "cores": cpu / elapsed, "rss_mb": rss, "anon_mb": anon, "processes": len(pids),
        "client_us": sum(r["client_cpu"] for r in results) / max(samples, 1) * 1e6,
        "errors": sum(r["errors"] for r in results), "samples": samples,
        "first_error": next((r["first_error"] for r in results if r["first_error"]), ""),
    }


def run(args: argparse.Namespace) -> int:
    store_url = prepare_store(args.images, args.data, args.cache_dir)
    ids = list(range(args.images)) if args.data == "random" else _ids(store_url)
    counts = [None] if args.workers == "default" else [int(w) for w in args.workers.split(",")]
    print(f"load: {args.clients} client process(es) x {args.connections} connections x {args.depth} pipelined "
          f"requests of {args.request_size} ids, {args.warmup:g} s warm-up + {args.seconds:g} s, {args.images} "
          f"{args.data} samples, {os.cpu_count()} cores shared by the server and the clients")
    failed = False
    medians = {}
    for workers in counts:
        runs = []
        for rep in range(args.repeats):
            r = run_once(args, store_url, ids, workers, rep)
            runs.append(r)
            failed |= bool(r["errors"]) or not r["samples"]
            print(f"  workers {workers or 'default'} run {rep + 1}: {r['samples_s']:8.0f} samples/s "
                  f"{r['mb_s']:7.1f} MB/s  server {r['cpu_us']:6.1f} us CPU per sample "
                  f"({r['cores']:.2f} cores, {r['processes']} processes, RSS {r['rss_mb']:.0f} MB, "
                  f"anonymous {r['anon_mb']:.0f} MB)  "
                  f"client {r['client_us']:5.1f} us per sample  errors {r['errors']}"
                  + (f" ({r['first_error']})" if r["first_error"] else ""), flush=True)
        med = {k: statistics.median(r[k] for r in runs) for k in ("samples_s", "mb_s", "cpu_us", "cores", "client_us")}
        medians[workers] = med
        n = workers or len(os.sched_getaffinity(0))
        print(f"  served      {med['samples_s']:10.0f} samples/s  {med['mb_s']:8.1f} MB/s  (workers {workers or 'default'},"
              f" median of {len(runs)})")
        print(f"  server CPU  {med['cpu_us']:.1f} us per sample ({med['cores']:.2f} cores busy, "
              f"{med['cores'] / n * 100:.0f}% of each of {n} workers)")
        print(f"  clients     {med['client_us']:.1f} us CPU per sample")
        print(f"  errors      {sum(r['errors'] for r in runs)}")
        print(f"  server RSS  {statistics.median(r['rss_mb'] for r in runs):.1f} MB (all processes, at the end; "
              f"anonymous {statistics.median(r['anon_mb'] for r in runs):.1f} MB, the rest mapped file pages)")
    if len(medians) > 1 and counts[0] in medians:
        base = medians[counts[0]]["samples_s"]
        for w in counts[1:]:
            print(f"  scaling     workers {w} serve {medians[w]['samples_s'] / base:.2f}x what workers {counts[0]} serve")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataferry.bench.load_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2",
                   help="comma-separated worker counts to compare, or 'default' for the server's own (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="runs per worker count; medians are shown")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of load before measuring")
    p.add_argument("--clients", type=int, default=1, help="load generator processes")
    p.add_argument("--connections", type=int, default=8, help="connections per client process")
    p.add_argument("--depth", type=int, default=2, help="pipelined requests per connection")
    p.add_argument("--images", type=int, default=2000, help="samples in the store")
    p.add_argument("--request-size", type=int, default=64, help="ids per request")
    p.add_argument("--data", choices=("synthetic", "random"), default="synthetic",
                   help="synthetic JPEGs (cached after the first run) or random bytes of JPEG-like sizes")
    p.add_argument("--cache-dir", help="where the store file is kept (default: the temp folder)")
    args = p.parse_args(argv)
    if args.request_size > args.images:
        p.error("--request-size must not exceed --images")
    if args.workers != "default" and not re.fullmatch(r"\d+(,\d+)*", args.workers):
        p.error("--workers takes counts like 1,2 or 'default'")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
