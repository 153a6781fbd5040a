"""A loader reading a SQLite store directly stays within its byte budget plus a
fixed overhead, in resident memory, not only in what Python allocates.

The budget (``Prefetch.max_bytes``) covers what the engine holds; on top of it
come the consumer's batches (the one it works on and the one it just let go
of) and a fixed overhead (threads, connections, page caches, the allocator).
What must not be there is memory that grows with the budget or with the
number of reader threads: SQLite page caches filled with blobs read once, or
malloc arenas of reader threads that keep freed blobs resident. Both are
invisible to tracemalloc (the page cache is SQLite's C heap; an arena's slack
is freed memory), so this measures RSS, in a fresh process.

Over HTTP the same holds against the real service on loopback: the engine's
accounting never above ``max_bytes`` (samples larger than the mean are
reserved for before they arrive), and RSS within 1.25 x ``max_bytes`` plus
the fixed allowance that ``client/README.md`` documents. And the engine's
bookkeeping does not grow with the dataset: after an epoch its per-position
structures hold only what is in flight or failed.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dataferry.client import Loader, MemorySource, Prefetch, Retry
from dataferry.client._tuner import Link
from dataferry.client._plan import make_plan
from dataferry.client._options import PlanOptions
from dataferry.schema import DatasetInfo, IdList, Sample, SampleMeta, open_store
from dataferry.schema._store import SampleRecord
from dataferry.server import make_app
from faults import Faults, FaultySource
from server_kit import live_server

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")

MiB = 1 << 20
SAMPLES, SIZE, BATCH = 600, 100_000, 16
#: threads, connections, SQLite's (small) page caches, the engine's
#: bookkeeping: 3.5 MiB measured here with tiny samples, about 1 MiB beyond the
#: consumer's batches with 100 KB ones, at either budget; twice that and more
#: for other allocators and kernels. Before the fix the path held 20 MiB more.
FIXED_OVERHEAD = 8 * MiB

_CHILD = r"""
import importlib, json, sys, time

# what opening a loader imports, imported before the baseline: code is not data
for name in ("sqlite3", "numpy.random", "numpy.ma", "uvloop", "aiohttp", "dataferry.schema.sources.http._source",
             "dataferry.schema.sources._open", "dataferry.schema.sources._sqlite"):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
from dataferry.client import Loader, Prefetch

def kib(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))

url, dataset, budget, batch_size, epochs, pause = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]), float(sys.argv[6])
base = kib("VmRSS")
with open("/proc/self/clear_refs", "w") as fh:  # reset VmHWM to the current RSS
    fh.write("5")
samples = 0
with Loader(url, dataset, batch_size=batch_size, prefetch=Prefetch(max_bytes=budget)) as loader:
    for _ in range(epochs):
        for batch in loader:
            samples += len(batch.data)
            time.sleep(pause)  # a consumer slower than the store
    peak_bytes = loader.stats().peak_bytes
print(json.dumps({"growth": (kib("VmHWM") - base) * 1024, "samples": samples, "peak_bytes": peak_bytes}))
"""


@pytest.fixture(scope="module")
def store_url(tmp_path_factory) -> str:
    """A store of 600 incompressible 100 KB samples (60 MB, well above the budgets)."""
    db = tmp_path_factory.mktemp("mem") / "mem.db"
    rng = np.random.default_rng(0)

    async def build():
        async with await open_store(f"sqlite://{db}") as store:
            await store.put_dataset(DatasetInfo("mem", ("a", "b"), SAMPLES, dt.datetime.now(dt.timezone.utc)))
            for start in range(0, SAMPLES, 50):
                records = []
                for i in range(start + 1, start + 51):
                    data = rng.integers(0, 256, SIZE, dtype=np.uint8).tobytes()
                    meta = SampleMeta(i, i % 2, f"c/{i}.jpg", "jpeg", 1, 1, SIZE, "0" * 64, {})
                    records.append(SampleRecord(Sample(i, i % 2, data), meta))
                await store.put_samples("mem", records)
            ids = np.arange(1, SAMPLES + 1, dtype=np.int64)
            await store.put_split("mem", "all", IdList(ids, (ids % 2).astype(np.int32)))

    asyncio.run(build())
    return f"sqlite://{db}"


@pytest.mark.parametrize("budget", [16 * MiB, 32 * MiB])
def test_sqlite_direct_loader_rss_stays_within_budget_plus_fixed_overhead(store_url, budget):
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, store_url, "mem", str(budget), str(BATCH), "3", "0.001"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["samples"] == 3 * SAMPLES
    assert got["peak_bytes"] <= budget  # the engine's own accounting
    consumer = 2 * BATCH * SIZE  # the batch in the training loop's hands, and the one before it
    bound = budget + consumer + FIXED_OVERHEAD
    assert got["growth"] <= bound, (
        f"peak RSS grew {got['growth'] / MiB:.1f} MiB for a {budget / MiB:.0f} MiB budget "
        f"(bound {bound / MiB:.1f} MiB: budget + consumer's batches {consumer / MiB:.1f} + fixed "
        f"{FIXED_OVERHEAD / MiB:.0f})"
    )


# --- over HTTP: the real service on loopback -------------------------------------------------------
HTTP_SAMPLES, HTTP_BATCH, HTTP_BUDGET = 640, 64, 16 * MiB
#: above 1.25 x max_bytes (client/README.md, "Memory"): receive arenas partly written or partly
#: held (4 MiB each), Python objects, connections and their buffers. Measured: 26-31 MiB in all
#: here (31-35 before the consumer's batch counted in the budget, and the accounting went over)
HTTP_ALLOWANCE = 16 * MiB


@pytest.fixture(scope="module")
def jpeg_sized_url(tmp_path_factory) -> str:
    """640 incompressible samples of JPEG sizes, 40-200 KB (mean 120 KB): sizes spread as photos'
    are, so a request's samples often carry more than the mean."""
    db = tmp_path_factory.mktemp("jpegs") / "jpegs.db"
    rng = np.random.default_rng(1)
    sizes = rng.integers(40_000, 200_000, HTTP_SAMPLES)

    async def build():
        async with await open_store(f"sqlite://{db}") as store:
            await store.put_dataset(DatasetInfo("jpegs", ("a", "b"), HTTP_SAMPLES, dt.datetime.now(dt.timezone.utc)))
            records = []
            for i, n in enumerate(sizes.tolist(), 1):
                data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
                meta = SampleMeta(i, i % 2, f"c/{i}.jpg", "JPEG", 1, 1, n, hashlib.sha256(data).hexdigest(), {})
                records.append(SampleRecord(Sample(i, i % 2, data), meta))
            await store.put_samples("jpegs", records)
            ids = np.arange(1, HTTP_SAMPLES + 1, dtype=np.int64)
            await store.put_split("jpegs", "all", IdList(ids, (ids % 2).astype(np.int32)))

    asyncio.run(build())
    return f"sqlite://{db}"


def test_http_loader_accounting_within_budget_and_rss_within_allowance(jpeg_sized_url):
    """Before: the engine reserved the mean size per sample, so requests of larger samples took
    the accounting past max_bytes; and the consumer's batch was outside it (RSS 1.7x the budget)."""
    with live_server(lambda: make_app(jpeg_sized_url)) as live:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, live.base, "jpegs", str(HTTP_BUDGET), str(HTTP_BATCH), "2", "0.01"],
            capture_output=True, text=True, timeout=120,
        )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["samples"] == 2 * HTTP_SAMPLES
    assert got["peak_bytes"] <= HTTP_BUDGET, f"the engine's accounting peaked at {got['peak_bytes']:,} B"
    bound = 1.25 * HTTP_BUDGET + HTTP_ALLOWANCE
    assert got["growth"] <= bound, (
        f"peak RSS grew {got['growth'] / MiB:.1f} MiB for a {HTTP_BUDGET / MiB:.0f} MiB budget "
        f"(bound {bound / MiB:.1f} MiB: 1.25 x budget + {HTTP_ALLOWANCE / MiB:.0f})"
    )


# --- bookkeeping per position -----------------------------------------------------------------------
def _epoch_structures(loader, ep) -> dict[str, int]:
    """Sizes of ``ep``'s per-position structures, read on the engine's loop once the requests of
    its end have been handled (the last batch can reach the consumer before they are)."""

    async def read():
        for _ in range(200):
            if not ep.active:
                break
            await asyncio.sleep(0.01)
        return {"attempts": len(ep.attempts), "first_fail": len(ep.first_fail), "cover": len(ep.cover),
                "held": len(ep.held), "retries": len(ep.retries), "active": ep.active}

    return loader._lt.call(read(), timeout=10)


NOTHING = dict.fromkeys(("attempts", "first_fail", "cover", "held", "retries", "active"), 0)


def test_after_an_epoch_the_engine_holds_nothing_per_position():
    """Before: ``attempts`` held every position sent, first tries included, until the epoch
    object went (~70 B a sample: 90 MB over ImageNet's 1.28M)."""
    n = 60_000
    with Loader(MemorySource.synthetic("d", n, size=8), "d", batch_size=512) as loader:
        it = iter(loader)
        next(it)
        ep = loader._run.current
        during = []
        for k, _ in enumerate(it):
            if k % 20 == 0:
                during.append(len(ep.attempts))
        assert ep.completed.complete
        assert _epoch_structures(loader, ep) == NOTHING
        assert max(during) == 0  # no position was retried: none is recorded


def test_retried_positions_are_recorded_until_they_complete():
    n = 4000
    src = FaultySource(MemorySource.synthetic("d", n, size=8), Faults(error=0.2, drop=0.1, seed=3))
    retry = Retry(deadline=30, timeout=5, backoff=0.001, max_backoff=0.005)
    with Loader(src, "d", batch_size=64, retry=retry) as loader:
        it = iter(loader)
        next(it)
        ep = loader._run.current
        most = 0
        for _ in it:
            most = max(most, len(ep.attempts))
        stats = loader.stats()
        after = _epoch_structures(loader, ep)
    assert stats.retries > 0 and 0 < most < n // 4, (stats.retries, most)
    assert after == NOTHING


def test_the_plan_and_done_set_hold_no_python_object_per_position():
    n = 1_281_167
    idl = IdList(np.arange(n, dtype=np.int64) * 3, (np.arange(n) % 1000).astype(np.int32))
    plan = make_plan(idl, 1, PlanOptions(seed=0, rank=0, world_size=1), digest="x")
    assert plan.order.dtype == np.int32 and plan.order.nbytes == 4 * n  # ids and labels stay in the split
    assert plan.split is idl
    from dataferry.client._doneset import DoneSet

    done = DoneSet(n)
    for p in range(0, n, 3):  # a third done, out of order: the worst case for a set of ints
        done.add(p)
    assert sys.getsizeof(done._done) <= n + 100
    assert len(done) == -(-n // 3) and done.frontier == 1


def test_one_outlier_sample_does_not_shrink_the_window_for_long():
    """Reservations follow the largest sample seen, but at most 3x the mean: one 4 MB sample among
    2 KB ones would otherwise reserve 4 MB an id for thousands of samples (a window of one request)."""
    samples = [Sample(i, 0, bytes(4 << 20) if i == 100 else bytes(2000)) for i in range(3000)]
    with Loader(MemorySource("d", samples), "d", batch_size=64, prefetch=Prefetch(max_bytes=64 << 20)) as loader:
        link = loader._link
        got, high, reserves, before = 0, 0.0, [], -1
        # read per batch: the figures move with the engine, whose look-ahead into the next epoch may
        # meet the outlier again just before a read at the end. A batch read while the engine
        # received nothing since the last one is not counted: the figure then is the one the engine
        # stopped at (in a full run it had the epoch in hand with the outlier among its last samples,
        # and the consumer read 16 more batches from memory), and no request waits on it
        async def figures():  # read together on the engine's loop: from this thread, the engine may
            return link.high_bytes, link.reserve_bytes, link.mean_bytes  # update the mean between two reads

        for b in loader:
            got += len(b)
            seen, reserve, mean = loader._lt.call(figures(), timeout=10)
            high = max(high, seen)
            assert reserve <= Link.RESERVE_CAP * mean + 1e-6
            received = loader.stats().received
            if received != before:
                reserves.append(reserve)
            before = received
        assert got == 3000
        assert high > 1 << 20  # the outlier was seen
        # a reservation of 64 KB or more (~3x a mean the outlier lifted) for a few batches, not for long
        assert sum(r >= 64_000 for r in reserves) <= 5, reserves
        assert loader.stats().peak_bytes <= 64 << 20


def test_samples_larger_than_the_hint_keep_the_accounting_within_the_budget():
    """Before: the first requests went out at ``sample_bytes_hint`` (128 KB) a sample until they
    filled the budget, before any size was known; samples of 200 KB took the accounting 1.5x past
    it (CI: 16.97 MB of a 16 MiB budget over HTTP, the JPEG-sized case above, 1 run in 10). Now,
    before a size is seen, a third of the budget goes out, and the requests in flight are topped
    up to the sizes seen as they arrive."""
    budget = 8 << 20
    samples = [Sample(i, 0, bytes(200_000 + i)) for i in range(400)]
    prefetch = Prefetch(max_bytes=budget, request_size=4, initial_inflight=64)
    # at once, after a round trip, and trickling over a 50 MB/s link (the first requests' samples
    # arrive while requests sent since are in flight: the top-up's case)
    for latency, rate in ((0.0, None), (0.05, None), (0.01, 50e6)):
        src = MemorySource("d", samples, latency=latency, rate=rate)
        with Loader(src, "d", batch_size=8, prefetch=prefetch) as loader:
            got = sum(len(b) for epoch in range(2) for b in loader)
            stats = loader.stats()
        assert got == 800
        assert stats.peak_bytes <= budget, f"{stats.peak_bytes:,} B held against a {budget:,} B budget"
