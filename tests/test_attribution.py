"""Live bottleneck attribution: each bottleneck made on purpose, and named.

Every test builds one limit with real parts (the engine, the real aiohttp
service on loopback behind the latency proxy, Pillow decode in threads, DALI's
CPU decoder) and a fake only at a seam we own (a source whose latency rises
with load), runs for a few 0.5 s intervals, and checks what the loader names
for the intervals after the first (warm-up). Nothing here asserts a rate.
"""

from __future__ import annotations

import asyncio

import logging
import re
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from faults import Faults, FaultySource, QueueingSource

from dataferry.client import Loader, MemorySource, Prefetch
from dataferry.client._attribution import LIMITS
from dataferry.client._metrics import ClientMetrics, serve_metrics
from dataferry.schema import Sample

INTERVAL = 0.5
ROOT = Path(__file__).resolve().parents[1]


def run_for(loader, seconds: float, *, it=None, per_batch: float = 0.0) -> list[str]:
    """Consume from ``it`` (default: the loader) for ``seconds``, sleeping
    ``per_batch`` after each batch; the limits of the intervals after the first."""
    source = loader if it is None else it
    t0 = time.monotonic()

    def enough() -> bool:  # on a loaded machine intervals close late: go on (up to 4x) until 4 have closed
        elapsed = time.monotonic() - t0
        return elapsed >= 4 * seconds or (elapsed >= seconds and len(loader.intervals()) >= 4)

    while not enough():
        for _ in source:
            if per_batch:
                time.sleep(per_batch)
            if enough():
                break
    return [iv.limit for iv in loader.intervals()[1:]]


def assert_named(limits: list[str], want: str) -> None:
    """At least 3 intervals after warm-up, and (allowing one hiccup of a shared
    machine in five) they name ``want``."""
    assert len(limits) >= 3, limits
    assert Counter(limits)[want] >= 0.8 * len(limits), limits


def named(source, *, max_inflight: int = 16):
    """A Loader on ``source`` (batch 32, 16 ids a request, at most ``max_inflight`` in flight) run for
    2.5 s: the limits of its intervals after the first, and its last interval."""
    with Loader(source, "d", batch_size=32, prefetch=Prefetch(max_inflight=max_inflight, request_size=16),
                log_interval=INTERVAL) as loader:
        return run_for(loader, 2.5), loader.intervals()[-1]


def big_jpeg(side: int = 1024) -> bytes:
    from test_torch_path import jpeg  # imports torch: only from the tests that need it

    return jpeg(np.random.default_rng(0), side, side)


def synthetic(n: int = 20000, size: int = 512, **kw) -> MemorySource:
    return MemorySource.synthetic("d", n, size=size, **kw)


# --- the four bottlenecks --------------------------------------------------------------------------
def test_a_slow_link_is_named_link():
    """100 ms per request and at most 2 requests in flight: the window is
    full and latency sits at its floor."""
    limits, last = named(synthetic(latency=0.1), max_inflight=2)
    assert_named(limits, "link")
    assert last.stats.window_full > 0 and last.floor is not None and last.floor >= 0.09


def test_a_slow_link_to_the_real_service_is_named_link(tmp_path):
    """The real aiohttp service on loopback behind the latency proxy (60 ms
    round trip), two requests in flight at most."""
    from server_kit import live_server, make_samples, seeded_db

    from dataferry.bench._latency_proxy import LinkOptions, ProxyThread
    from dataferry.server import make_app

    url = seeded_db(tmp_path / "s.db", "d", make_samples(3000, size=300))
    with live_server(lambda: make_app(url)) as live, \
            ProxyThread(("127.0.0.1", live.port), LinkOptions(delay=0.03)) as proxy:
        host, port = proxy.address
        limits, _ = named(f"http://{host}:{port}", max_inflight=2)
    assert_named(limits, "link")


def test_a_service_whose_latency_rises_with_load_is_named_service():
    """Two workers at 20 ms a request: more requests in flight only queue."""
    limits, last = named(QueueingSource("d", synthetic().samples.values(), slots=2, service=0.02))
    evidence = last.evidence
    assert_named(limits, "service")
    assert "its floor" in evidence and "queued at the service" in evidence


def test_queueing_at_the_real_service_is_named_service(tmp_path):
    """The real service with 2 request slots over a store that takes 20 ms a
    fetch: requests beyond two wait in the server's line."""
    from server_kit import live_server, make_samples, seeded_db

    from dataferry.schema import open_store
    from dataferry.server import ServerOptions, make_app

    url = seeded_db(tmp_path / "s.db", "d", make_samples(3000, size=300))

    async def build():
        store = await open_store(url, create=False)
        slow = FaultySource(store, Faults(slow=1.0, slow_delay=0.02))  # every fetch first takes 20 ms (a slow disk)
        return make_app(slow, ServerOptions(max_concurrent=2, queue_timeout=30))

    with live_server(build) as live:
        limits, _ = named(live.base)
    assert_named(limits, "service")


class _BusySource(MemorySource):
    """Answers after ``delay`` s, each sample costing the engine's thread ``cpu`` s of CPU (a client
    whose receive, checks and assembly cannot keep up: the GPU machine's one engine thread)."""

    def __init__(self, *args, delay: float = 0.01, cpu: float = 0.0005, **kw) -> None:
        super().__init__(*args, **kw)
        self.delay, self.cpu = delay, cpu

    async def fetch(self, dataset, ids):
        await asyncio.sleep(self.delay)
        async for result in super().fetch(dataset, ids):
            end = time.thread_time() + self.cpu
            while time.thread_time() < end:
                pass
            yield result


def test_a_busy_engine_thread_is_named_engine_not_the_service():
    """Latency rises because answers wait for the engine's thread, not at the service: named engine."""
    limits, last = named(_BusySource("d", synthetic(5000).samples.values()))
    evidence = last.evidence
    assert_named(limits, "engine")
    assert "the engine's thread was on CPU" in evidence and "ProcessLoader(engines=N)" in evidence


def test_a_slow_decode_is_named_decode():
    """1024 x 1024 JPEGs, one Pillow thread, an in-memory source: decode is the limit."""
    torch = pytest.importorskip("torch")  # noqa: F841
    from dataferry.client import TorchIterator, TrainTransform

    blob = big_jpeg()
    src = MemorySource("d", [Sample(i, i % 5, blob) for i in range(2000)])
    with Loader(src, "d", batch_size=8, log_interval=INTERVAL) as loader:
        it = TorchIterator(loader, TrainTransform(size=64), workers=1)
        try:
            limits = run_for(loader, 2.5, it=it)
        finally:
            it.close()
        last = loader.intervals()[-1]
    assert_named(limits, "decode")
    assert last.stats.decode_threads == 1 and last.stats.decode_busy > 0 and last.stats.decode_depth == 2


def test_a_slow_decode_in_dali_is_named_decode():
    """DALI's CPU decoder on one thread, large JPEGs."""
    pytest.importorskip("torch")
    pytest.importorskip("nvidia.dali")
    from dataferry.client import DaliIterator, DaliOptions, TrainTransform

    blob = big_jpeg(1536)
    src = MemorySource("d", [Sample(i, i % 5, blob) for i in range(2000)])
    with Loader(src, "d", batch_size=8, log_interval=INTERVAL) as loader:
        it = DaliIterator(loader, TrainTransform(size=64), options=DaliOptions(device="cpu", num_threads=1))
        try:
            limits = run_for(loader, 2.5, it=it)
        finally:
            it.close()
    assert_named(limits, "decode")


@pytest.mark.parametrize("path", ["loader", "torch"])
def test_a_slow_consumer_is_named_consumer(path):
    """The training loop sleeps 50 ms a batch; data is ready when it asks."""
    if path == "torch":
        pytest.importorskip("torch")
        from dataferry.client import EvalTransform, TorchIterator

        from test_torch_path import jpeg_samples

        small = jpeg_samples(100)  # 2000 samples: no epoch boundary (where the decode queue refills) in the run
        src = MemorySource("d", [Sample(i, i % 5, small[i % 100].data) for i in range(2000)])
    else:
        src = synthetic(latency=0.01)
    with Loader(src, "d", batch_size=16, log_interval=INTERVAL) as loader:
        it = TorchIterator(loader, EvalTransform(size=32), workers=2) if path == "torch" else None
        try:
            limits = run_for(loader, 2.5, it=it, per_batch=0.05)
        finally:
            if it is not None:
                it.close()
    assert_named(limits, "consumer")


# --- the line, the figures, the export -----------------------------------------------------------
def test_each_interval_is_one_log_line_with_the_verdict_and_its_evidence(caplog):
    src = synthetic(latency=0.05)
    with caplog.at_level(logging.INFO, logger="dataferry.client"):
        with Loader(src, "d", batch_size=32, prefetch=Prefetch(max_inflight=2, request_size=16),
                    log_interval=0.2) as loader:
            run_for(loader, 1.0)
            n = len(loader.intervals())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("d: limited by")]
    assert len(lines) >= n >= 3
    assert all("\n" not in line and "samples/s" in line and "loop waited" in line for line in lines)
    assert "limited by link (the loop waited" in lines[-1] and "window full" in lines[-1]


def test_intervals_add_up_to_the_totals_and_a_loop_that_asks_nothing_is_the_limit():
    src = synthetic(n=2000)
    with Loader(src, "d", batch_size=100, log_interval=0.3) as loader:
        total = sum(len(b) for b in loader)
        time.sleep(0.7)
        ivs = loader.intervals()
        stats = loader.stats()
    assert sum(iv.stats.samples for iv in ivs) == total == stats.samples == 2000
    assert all(b.start == pytest.approx(a.end, abs=1e-9) for a, b in zip(ivs, ivs[1:]))
    assert ivs[-1].limit == "consumer"  # the loop asked for nothing after the epoch: data was not its limit


def test_the_prometheus_export_serves_the_metrics_over_http():
    """A real GET of /metrics: every family is a documented dataferry_client_
    one, the counts are the loader's, the last interval's limit is 1."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    src = synthetic(latency=0.05)
    with Loader(src, "d", batch_size=32, prefetch=Prefetch(max_inflight=2, request_size=16),
                log_interval=0.25) as loader:
        metrics = serve_metrics(loader, 0, name="train")
        try:
            run_for(loader, 1.2)
            stats = loader.stats()
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10) as resp:
                assert resp.status == 200
                text = resp.read().decode()
        finally:
            metrics.close()
        mounted = CollectorRegistry()
        ClientMetrics(registry=mounted).watch(loader)
        assert 'dataferry_client_samples_total{loader="d/all"}' in generate_latest(mounted).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert values[("dataferry_client_samples_total", (("loader", "train"),))] >= stats.samples > 0
    assert values[("dataferry_client_requests_total", (("loader", "train"),))] >= stats.requests > 0
    limits = {lim: values[("dataferry_client_limit", (("limit", lim), ("loader", "train")))] for lim in LIMITS}
    assert limits["link"] == 1.0 and sum(limits.values()) == 1.0
    assert values[("dataferry_client_limited_seconds_total", (("limit", "link"), ("loader", "train")))] > 0
    # named next to the server's metrics, and nothing named there that is not real
    doc = (ROOT / "deploy" / "OPERATIONS.md").read_text()
    names = re.findall(r"^# TYPE (\S+) \S+$", text, re.M)
    assert all(n.startswith("dataferry_client_") for n in names)
    assert not [n for n in names if f"`{n}`" not in doc], "OPERATIONS.md does not list them"
    documented = set(re.findall(r"`(dataferry_client_[a-z_]+)`", doc))
    assert documented <= set(names), documented - set(names)


def test_the_train_bench_plots_throughput_wait_and_the_limit_per_interval(tmp_path):
    """``bench.train.plot_intervals`` on a real loader's intervals: a PNG, and
    the shares of time per limit that its legend shows."""
    from dataferry.bench.train import limit_shares, plot_intervals

    src = synthetic(latency=0.05)
    with Loader(src, "d", batch_size=32, prefetch=Prefetch(max_inflight=2, request_size=16),
                log_interval=0.2) as loader:
        run_for(loader, 0.7)
        run_for(loader, 0.7, per_batch=0.05)  # then the consumer is the limit
        intervals = loader.intervals()
    shares = limit_shares(intervals)
    assert set(shares) == {"link", "consumer"} and sum(shares.values()) == pytest.approx(1.0)
    png = plot_intervals(intervals, str(tmp_path / "t.png"), "test")
    data = Path(png).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
