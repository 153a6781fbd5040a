"""The server's memory levels off under steady load.

Two views (``bench/results/server_memory.md`` has the long run and what it
found): what Python holds per request (tracemalloc around the real app in this
process, through every kind of request a job and a stranger send: batches,
catalog, split lists, unknown datasets and paths, metrics scrapes, new
connections, clients hanging up mid-response), and each worker's anonymous
memory (``RssAnon``) under ``dataferry serve --workers 2`` and raw-socket
clients (``bench/server_memory.py``, short rounds).
"""

from __future__ import annotations

import asyncio
import gc
import sys
import tracemalloc

import aiohttp
import numpy as np
import pytest

from dataferry.schema import open_store
from dataferry.server import make_app

from server_kit import make_samples, seed, serve

DATASET = "mem"


async def _mix(base: str, ids: list[int], rounds: int, seed_: int) -> None:
    """``rounds`` rounds of every kind of request, on a fresh connection every round."""
    rng = np.random.default_rng(seed_)
    body_ids = np.asarray(ids, dtype="<i8")
    for r in range(rounds):
        async with aiohttp.ClientSession() as s:  # a new connection (and client) each round
            for _ in range(4):
                pick = rng.choice(body_ids, 16, replace=False).astype("<i8").tobytes()
                async with s.post(f"{base}/v1/datasets/{DATASET}/samples", data=pick,
                                  headers={"Content-Type": "application/octet-stream"}) as resp:
                    assert resp.status == 200
                    await resp.read()
            unknown = f"ds{rng.integers(1 << 40)}"  # a new name every time: nothing may be kept per name
            async with s.post(f"{base}/v1/datasets/{unknown}/samples", data=body_ids[:2].tobytes(),
                              headers={"Content-Type": "application/octet-stream"}) as resp:
                assert resp.status == 404
            async with s.get(f"{base}/no/such/path/{rng.integers(1 << 40)}") as resp:
                assert resp.status == 404
            async with s.get(f"{base}/v1/datasets/{DATASET}/splits/all") as resp:
                assert resp.status == 200
                await resp.read()
            async with s.get(f"{base}/v1/datasets/{DATASET}") as resp:
                assert resp.status == 200
            async with s.post(f"{base}/v1/datasets/{DATASET}/samples", data=b"\x00" * 7,
                              headers={"Content-Type": "application/octet-stream"}) as resp:
                assert resp.status == 400
            if r % 8 == 0:
                async with s.get(f"{base}/metrics") as resp:
                    assert resp.status == 200
                    await resp.read()
            # a client that hangs up after the first bytes of a large answer
            async with s.post(f"{base}/v1/datasets/{DATASET}/samples", data=body_ids.tobytes(),
                              headers={"Content-Type": "application/octet-stream"}) as resp:
                await resp.content.readexactly(64)
                resp.close()


async def _strangers(base: str, n: int) -> None:
    async with aiohttp.ClientSession() as s:
        for k in range(n):
            async with s.get(f"{base}/no/such/path/warm{k}") as resp:
                assert resp.status == 404


def test_python_memory_per_request_stays_flat(tmp_path):
    async def go() -> tuple[int, list]:
        samples = make_samples(48, size=20_000)
        async with await open_store(f"sqlite://{tmp_path / 'm.db'}") as store:
            await seed(store, DATASET, samples)
            ids = [s.id for s in samples]
            async with serve(make_app(store)) as base:
                # traced from the warm-up on: what a bounded cache drops later is then counted as freed
                tracemalloc.start(8)
                try:
                    await _mix(base, ids, 30, 0)  # warm-up: pools, caches, the interpreter's free lists
                    await _strangers(base, 300)  # yarl's URL caches (128 entries) full of unknown paths
                    await asyncio.sleep(0.1)
                    gc.collect()
                    before = tracemalloc.take_snapshot()
                    await _mix(base, ids, 80, 1)  # ~800 requests, 80 connections
                    await asyncio.sleep(0.1)
                    gc.collect()
                    after = tracemalloc.take_snapshot()
                finally:
                    tracemalloc.stop()
        # what the server side allocated (this process is also the client): a frame in our server
        # package or aiohttp's server modules
        keep = [tracemalloc.Filter(True, "*/server/_*.py", all_frames=True),
                tracemalloc.Filter(True, "*/aiohttp/web_*.py", all_frames=True)]
        diffs = after.filter_traces(keep).compare_to(before.filter_traces(keep), "traceback")
        return sum(d.size_diff for d in diffs), diffs[:5]

    grew, top = asyncio.run(go())
    where = "\n".join(f"{d.size_diff:+} B ({d.count_diff:+d}) " + " <- ".join(
        f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in d.traceback) for d in top)
    # measured: -4 KiB; keeping 120 bytes per batch request (480 of them here) is +64 KiB
    assert grew < 32 * 1024, f"the server's Python memory grew by {grew} B over 800 requests; the top sites:\n{where}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_workers_anonymous_memory_levels_off(tmp_path, capsys):
    from dataferry.bench.server_memory import main

    status = main(["--workers", "2", "--clients", "3", "--rounds", "4", "--seconds", "4", "--images", "300",
                   "--cache-dir", str(tmp_path), "--bound", "0.25"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "GREW" not in out and "flat" in out, out
