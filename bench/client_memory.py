"""The client's resident memory: over an epoch of a large dataset, and over HTTP against its byte budget.

    python -m dataferry.bench.client_memory [--samples 1281167] [--http-samples 3200]
                                            [--repeats 3] [--parts sqlite,http] [--folder DIR]
                                            [--http-batch 64]

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ._common import data_server, table

MiB = 1 << 20
DATASET = "memory"
BATCH, HTTP_BATCH = 256, 64
HTTP_BUDGET = 32 * MiB
SLOW_S = 0.02
#: the fixed allowance above 1.25 x the budget (client/README.md, "Memory"; tests/test_memory_bound.py)
ALLOWANCE = 16 * MiB

_PRELUDE = r"""
import importlib, json, sys, time
for name in ("sqlite3", "numpy.random", "numpy.ma", "uvloop", "aiohttp", "dataferry.client",
             "dataferry.schema.sources.http._source", "dataferry.schema.sources._open", "dataferry.schema.sources._sqlite"):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
from dataferry.client import Loader, Prefetch

def kib(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))

base = kib("VmRSS")
with open("/proc/self/clear_refs", "w") as fh:  # VmHWM from here
    fh.write("5")
"""

_SQLITE_CHILD = _PRELUDE + r"""
url, dataset, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {}
t0 = time.perf_counter()
with Loader(url, dataset, batch_size=batch) as loader:
    n = len(loader)  # batches per epoch
    seen = 0
    for i, b in enumerate(loader):
        if i == 0:
            out["first_s"] = time.perf_counter() - t0
            out["first"] = kib("VmRSS") - base
            t1 = time.perf_counter()
        seen += len(b)
        if "at30" not in out and i >= 0.3 * n:
            out["at30"] = kib("VmRSS") - base
    out["rate"] = seen / (time.perf_counter() - t1)
    out["end"] = kib("VmRSS") - base
    for b in loader:
        out["next"] = kib("VmRSS") - base
        break
    out["hwm"] = kib("VmHWM") - base
    out["samples"] = seen
print(json.dumps(out))
"""

_HTTP_CHILD = _PRELUDE + r"""
url, dataset, batch, budget, slow = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
seen = 0
with Loader(url, dataset, batch_size=batch, prefetch=Prefetch(max_bytes=budget)) as loader:
    for _ in range(2):
        for b in loader:
            seen += len(b)
            time.sleep(slow)
    peak = loader.stats().peak_bytes
print(json.dumps({"growth": (kib("VmHWM") - base), "peak": peak, "samples": seen}))
"""


def sqlite_store(samples: int, folder: str) -> str:
    """A store of ``samples`` 16-byte samples, built once per size in ``folder``."""
    path = os.path.join(folder, f"dataferry-client-memory-{samples}.db")
    url = f"sqlite://{path}"
    asyncio.run(_fill_tiny(url, samples))
    return url


async def _fill_tiny(url: str, samples: int) -> None:
    import datetime as dt
    import hashlib

    import numpy as np

    from dataferry.schema import DatasetInfo, IdList, Sample, SampleMeta, SampleRecord, open_store

    async with await open_store(url) as store:
        try:
            if (await store.get_dataset(DATASET)).num_samples == samples:
                return
        except LookupError:
            pass
        t0 = time.perf_counter()
        chunk = 50_000
        for start in range(1, samples + 1, chunk):
            records = []
            for i in range(start, min(start + chunk, samples + 1)):
                data = i.to_bytes(16, "little")
                meta = SampleMeta(i, i % 1000, f"c/{i}.bin", "raw", 1, 1, 16, hashlib.sha256(data).hexdigest(), {})
                records.append(SampleRecord(Sample(i, i % 1000, data), meta))
            await store.put_samples(DATASET, records)
        ids = np.arange(1, samples + 1, dtype=np.int64)
        await store.put_split(DATASET, "all", IdList(ids, (ids % 1000).astype(np.int32)))
        # the dataset record last: its count says the store is whole
        await store.put_dataset(DatasetInfo(DATASET, tuple(f"c{k}" for k in range(1000)), samples,
                                            dt.datetime.now(dt.timezone.utc)))
        print(f"built {samples:,} samples in {time.perf_counter() - t0:.0f} s -> {url}", flush=True)


def _child(code: str, *args: object, timeout: float = 900) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"measuring process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_sqlite(samples: int, repeats: int, folder: str) -> str:
    url = sqlite_store(samples, folder)
    runs = [_child(_SQLITE_CHILD, url, DATASET, BATCH) for _ in range(repeats)]
    med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
    mb = lambda k: f"{med(k) * 1024 / 1e6:,.1f}"  # noqa: E731
    rows = [[f"{samples:,}", mb("first"), mb("at30"), mb("end"), mb("next"), mb("hwm"),
             f"{med('first_s'):.2f}", f"{med('rate'):,.0f}"]]
    return table(["samples", "RSS first batch MB", "at 30% MB", "epoch end MB", "next epoch MB", "peak MB",
                  "first batch s", "samples/s"], rows) + (
        f"\n\nRSS above the baseline (after imports), medians of {repeats} fresh processes; "
        f"growth first batch -> epoch end {(med('end') - med('first')) * 1024 / 1e6:,.1f} MB "
        f"({(med('end') - med('first')) * 1024 / samples:,.1f} B/sample)")


def run_http(samples: int, repeats: int, folder: str, batch: int = HTTP_BATCH) -> str:
    from .load_server import DATASET as HTTP_DATASET, prepare_store

    url = prepare_store(samples, "random", folder)
    with data_server(url) as (host, port):
        runs = [_child(_HTTP_CHILD, f"http://{host}:{port}", HTTP_DATASET, batch, HTTP_BUDGET, SLOW_S * batch / HTTP_BATCH)
                for _ in range(repeats)]
    growth = statistics.median(r["growth"] for r in runs) * 1024
    peak = statistics.median(r["peak"] for r in runs)
    worst = max(r["peak"] for r in runs)
    bound = 1.25 * HTTP_BUDGET + ALLOWANCE
    rows = [[f"{HTTP_BUDGET / MiB:.0f}", f"{growth / MiB:,.1f}", f"{growth / HTTP_BUDGET:.2f}",
             f"{bound / MiB:,.1f}", f"{peak:,.0f}", f"{worst:,.0f}", f"{HTTP_BUDGET:,}"]]
    return table(["budget MiB", "RSS above baseline MiB", "x budget", "allowed MiB", "peak accounting B",
                  "worst of runs B", "budget B"], rows) + (
        f"\n\n{samples:,} samples of 110 KB +- 30 KB, two epochs, batch {batch}, consumer {SLOW_S * 1e3 * batch / HTTP_BATCH:.0f} ms a "
        f"batch; medians of {repeats} fresh processes; peak RSS of each run: "
        + ", ".join(f"{r['growth'] * 1024 / MiB:.1f}" for r in runs) + " MiB")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataferry.bench.client_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=1_281_167, help="samples in the SQLite store (default 1,281,167)")
    p.add_argument("--http-samples", type=int, default=3200, help="samples served over HTTP (default 3200)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per part; medians printed (default 3)")
    p.add_argument("--parts", default="sqlite,http", help="comma-separated: sqlite, http (default both)")
    p.add_argument("--http-batch", type=int, default=HTTP_BATCH, help="batch size over HTTP (default 64)")
    p.add_argument("--folder", default=tempfile.gettempdir(), help="where the stores are cached (default the temp folder)")
    args = p.parse_args(argv)
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if parts - {"sqlite", "http"}:
        p.error(f"unknown parts: {', '.join(sorted(parts - {'sqlite', 'http'}))}")
    if "sqlite" in parts:
        print("## SQLite direct: an epoch of a large dataset\n", flush=True)
        print(run_sqlite(args.samples, args.repeats, args.folder) + "\n", flush=True)
    if "http" in parts:
        print("## HTTP: RSS and accounting against Prefetch(max_bytes=32 MiB)\n", flush=True)
        print(run_http(args.http_samples, args.repeats, args.folder, args.http_batch) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
