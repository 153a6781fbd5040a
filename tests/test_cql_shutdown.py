"""A closed CQL Loader (or store, or cluster) leaves no thread running and no CPU burning.

The cassandra-driver's libev reactor shares one event-loop thread per process.
Its timer watcher repeats at the last interval it was given, and nothing
stopped it once no timer was pending: the thread never ended, and once
requests orphaned by ``Cluster.shutdown()`` reached their deadlines (the
request timeout after the close) the interval left behind was the tiny gap
between the last two deadlines, so the thread spun a core (about 30 s after
the bench closed a Loader: its request timeout). These tests use a short
``request_timeout`` so that such deadlines pass within the test; the store's
``close()`` lets requests in flight answer first, so a closed Loader leaves
none behind and the thread ends at once.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from dataferry.client import Loader
from dataferry.bench._latency_proxy import LinkOptions, ProxyThread
from dataferry.schema import Sample, StoreUnavailable, open_store, parse_store_url
from server_kit import seed_url
from dataferry.schema.sources.cassandra._connect import connect

pytestmark = pytest.mark.cassandra

N = 300
QUIET_CPU_S = 0.2  # CPU seconds the whole process may use over the quiet window
QUIET_WINDOW_S = 3.0


@pytest.fixture(scope="module")
def cql_dataset(cassandra_url):
    """``(url, dataset)`` with N small samples in the session keyspace."""
    name = "shutdown_cql"
    rng = np.random.default_rng(1)
    seed_url(cassandra_url, name, [Sample(i, i % 3, rng.integers(0, 256, 1000, dtype=np.uint8).tobytes()) for i in range(N)])
    return cassandra_url, name


def _via(url: str, proxy: ProxyThread, **options) -> str:
    host, port = proxy.address
    rest = url.split("//", 1)[1].split("/", 1)[1]
    return f"cassandra://{host}:{port}/{rest}?" + "&".join(f"{k}={v}" for k, v in options.items())


def _upstream(url: str) -> tuple[str, int]:
    host, _, port = url.split("//", 1)[1].split("/", 1)[0].rpartition(":")
    return host, int(port)


#: The libev reactor's thread (``cassandra.io.libevreactor``): one per process, shared by every
#: cluster, so an earlier test or fixture may have started it; it counts wherever it came from.
DRIVER_LOOP = "event_loop"


def _baseline() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name != DRIVER_LOOP}


def _left_running(before: set[threading.Thread], wait: float) -> list[str]:
    """Names of threads not in ``before`` still alive after up to ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        new = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not new or time.monotonic() >= deadline:
            return sorted(t.name for t in new)
        new[0].join(min(0.1, max(0.0, deadline - time.monotonic())))


def _cpu_over(seconds: float) -> float:
    """CPU seconds this process (every thread) uses while the test sleeps ``seconds``."""
    start = time.process_time()
    time.sleep(seconds)
    return time.process_time() - start


def _assert_quiet(before: set[threading.Thread], what: str, *, settle: float) -> None:
    # ``settle`` covers the request timeout: a deadline left behind fires within it
    left = _left_running(before, wait=settle)
    cpu = _cpu_over(QUIET_WINDOW_S)
    left += [n for n in _left_running(before, wait=0) if n not in left]
    assert not left and cpu < QUIET_CPU_S, (
        f"after {what}: threads still running {left}; {cpu:.2f} s of CPU over the next {QUIET_WINDOW_S} s"
    )


def _stream(url: str, name: str, batches: int) -> None:
    with Loader(url, name, batch_size=16) as loader:
        it = iter(loader)
        for _ in range(batches):
            assert len(next(it)) == 16
        # closed here with prefetched requests in flight across the proxy


def test_closed_cql_loader_leaves_no_thread_and_burns_no_cpu(cql_dataset):
    url, name = cql_dataset
    with ProxyThread(_upstream(url), LinkOptions(delay=0.01, jitter=0.005)) as proxy:
        target = _via(url, proxy, request_timeout=2)
        before = _baseline()
        _stream(target, name, batches=4)
        # settle < request_timeout: nothing may be waiting for a deadline; the CPU window covers them
        _assert_quiet(before, "the first Loader closed", settle=1.0)
        # the driver starts its loop again for the next cluster, and that one goes quiet as well
        _stream(target, name, batches=2)
        _assert_quiet(before, "the second Loader closed", settle=1.0)


def test_store_closed_mid_fetch_stops_issuing_and_waits_for_answers(cql_dataset):
    url, name = cql_dataset
    with ProxyThread(_upstream(url), LinkOptions(delay=0.02)) as proxy:
        target = _via(url, proxy, concurrency=8)
        before = _baseline()

        async def go():
            store = await open_store(target, create=False)
            got = []

            async def read():
                async for result in store.fetch(name, range(N)):
                    got.append(result.id)

            task = asyncio.create_task(read())
            while len(got) < 20 and not task.done():
                await asyncio.sleep(0.01)
            await store.close()
            with pytest.raises(StoreUnavailable, match=r"cassandra store 127\.0\.0\.1:\d+/\w+ is closed"):
                await task
            return got

        got = asyncio.run(go())
        assert 20 <= len(got) < N and len(set(got)) == len(got)
        _assert_quiet(before, "a store closed mid-fetch", settle=1.0)


def test_cluster_shut_down_with_requests_in_flight_goes_quiet(cassandra_url):
    """The root cause alone: requests orphaned by ``shutdown()`` time out later, then nothing runs."""
    opts = parse_store_url(cassandra_url)
    before = _baseline()
    cluster, session, _ = connect(opts)
    for _ in range(300):
        session.execute_async("SELECT key FROM system.local", timeout=0.5)
    cluster.shutdown()
    _assert_quiet(before, "Cluster.shutdown() with 300 requests in flight", settle=2.5)


def test_a_store_that_fails_to_open_leaves_no_thread(cassandra_server):
    """A missing keyspace closes the cluster at once: connections the pool was
    still opening in the background kept the driver's IO loop alive for good."""
    host, port = cassandra_server
    before = _baseline()
    with pytest.raises(StoreUnavailable, match="no_such_keyspace"):
        asyncio.run(open_store(f"cassandra://{host}:{port}/no_such_keyspace"))
    _assert_quiet(before, "a store failed to open", settle=1.0)
