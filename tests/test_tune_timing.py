"""The tuner tells a busy server from a long link by the service's Server-Timing header
(issue 25): the server's time is taken out of a request's, and the window's floor and the
long-link request cap follow the link's own round trip. The service's Dataferry-Work header
tells the request sizer the server's CPU per sample."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from dataferry.client import Hedge, Prefetch
from dataferry.client._tuner import Link
from dataferry.schema import open_store
from dataferry.schema.sources.http._source import HttpSource
from dataferry.schema.sources.http._timing import ServiceTiming
from dataferry.server import make_app
from server_kit import make_samples, run, seed, serve


class SlowStore:
    """A store whose reads wait ``delay`` seconds first: a busy server, on a link of no length."""

    def __init__(self, inner, delay: float) -> None:
        self._inner, self.delay = inner, delay

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def fetch(self, dataset, ids):
        await asyncio.sleep(self.delay)
        async for rec in self._inner.fetch(dataset, ids):
            yield rec


@contextlib.asynccontextmanager
async def _service(tmp_path, samples, wrap=lambda store: store):
    """The real app over a SQLite store of ``samples`` (dataset ``d``, the store through ``wrap``)
    on loopback: its base URL."""
    async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
        await seed(store, "d", samples)
        async with serve(make_app(wrap(store))) as base:
            yield base


async def _heads(base: str, ids: list[int], header: str, times: int = 1) -> list[str]:
    """``header`` of ``times`` batch fetches of ``ids`` in a row, each read to its end."""
    got = []
    async with aiohttp.ClientSession() as http:
        for _ in range(times):
            async with http.post(f"{base}/v1/datasets/d/samples", json={"ids": ids}) as resp:
                got.append(resp.headers[header])
                await resp.read()
    return got


def test_the_server_reports_its_time_and_the_source_takes_it_out_of_the_round_trip(tmp_path):
    samples = make_samples(8, size=1000)
    ids = [s.id for s in samples]

    async def go():
        async with _service(tmp_path, samples, lambda store: SlowStore(store, 0.08)) as base:
            (timing,) = await _heads(base, ids, "Server-Timing")
            async with await HttpSource.open(base) as src:
                got = [r async for r in src.fetch("d", ids)]
                assert src.link_rtt is None  # a new connection's first request: its connect counts
                t0 = asyncio.get_running_loop().time()
                got = [r async for r in src.fetch("d", ids)]
                took = asyncio.get_running_loop().time() - t0
                return timing, src.link_rtt, took, len(got)

    timing, link_rtt, took, n = run(go())
    assert n == 8
    assert timing.startswith("first;dur=") and float(timing[10:]) >= 80, timing
    assert took >= 0.08 and link_rtt is not None and link_rtt < 0.04, (took, link_rtt)


def test_the_server_tells_its_cpu_and_samples_and_the_source_sums_them_between_answers(tmp_path):
    samples = make_samples(40, size=20_000)
    ids = [s.id for s in samples]

    async def go():
        async with _service(tmp_path, samples) as base:
            heads = await _heads(base, ids, "Dataferry-Work", times=2)
            async with await HttpSource.open(base) as src:
                told = [src.server_work]
                for _ in range(3):
                    assert len([r async for r in src.fetch("d", ids)]) == 40
                    told.append(src.server_work)
                return heads, told

    heads, told = run(go())
    fields = [dict(p.split("=") for p in h.split("; ")) for h in heads]
    assert fields[0]["worker"] == fields[1]["worker"] and len(fields[0]["worker"]) == 8, heads
    # told as the response starts: the samples answered before it
    assert int(fields[1]["samples"]) - int(fields[0]["samples"]) == 40, heads
    assert int(fields[1]["cpu_us"]) > int(fields[0]["cpu_us"]) >= 0, heads
    # the first answer to this source is its baseline; each later one adds what was done between
    assert told[0] == told[1] == (0.0, 0) and [n for _, n in told[2:]] == [40, 80], told
    assert 0 < told[2][0] < told[3][0], told


def test_a_worker_header_that_goes_back_or_does_not_parse_adds_nothing():
    t = ServiceTiming()
    t.worked("worker=a; cpu_us=1000; samples=10")
    t.worked("worker=a; cpu_us=3000; samples=30")
    t.worked("worker=b; cpu_us=500; samples=5")
    assert t.server_work == (0.002, 20)
    t.worked("worker=a; cpu_us=100; samples=1")  # restarted under the same name: a new baseline
    t.worked("worker=a; cpu_us=nonsense; samples=2")
    t.worked("cpu_us=1; samples=2")
    t.worked("")
    assert t.server_work == (0.002, 20)
    t.worked("worker=a; cpu_us=1100; samples=11")
    assert t.server_work == (0.003, 30)
    for k in range(300):  # workers come and go: the most recent are kept
        t.worked(f"worker=w{k}; cpu_us=1; samples=1")
    assert len(t._workers) <= ServiceTiming.WORKERS + 1 and "w299" in t._workers and "a" not in t._workers


def test_the_link_round_trip_from_the_source_decides_the_floor_and_the_long_link_cap():
    def link(told):
        k = Link(Prefetch(), Hedge(enabled=False))
        k.start(256, 32, 128, link_rtt=told)
        k.mean_bytes = 100_000.0
        k.min_first = 0.03  # 30 ms to a first answer: a long link by latency alone
        return k

    busy_server = link(lambda: 0.002)  # but the server says 28 of them were its own
    assert busy_server.link_round_trip() == 0.002
    assert busy_server._floor() == Link.LOCAL_WINDOW
    assert busy_server._size_cap() == Link.REQUEST_BYTES // 100_000  # not the long link's 6 MiB
    far = link(None)  # no Server-Timing (an older server, another source): latency alone
    assert far.link_round_trip() == 0.03
    assert far._floor() == Link.MIN_WINDOW
    assert far._size_cap() == Link.WAN_REQUEST_BYTES // 100_000
