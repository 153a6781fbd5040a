"""The engine on the CQL path: a real Cassandra behind the latency proxy."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pytest

from dataferry.bench._latency_proxy import LinkOptions, ProxyThread
from dataferry.client import Hedge, Loader, Prefetch, Retry
from dataferry.schema import Sample, open_store
from server_kit import seed_url
from faults import Faults, FaultySource

pytestmark = pytest.mark.cassandra

N = 400


@pytest.fixture(scope="module")
def cql_dataset(cassandra_url):
    """``(url, dataset)`` with N small samples in the session keyspace."""
    name = "engine_cql"
    rng = np.random.default_rng(0)
    samples = [Sample(i, i % 3, rng.integers(0, 256, 2000 + i, dtype=np.uint8).tobytes()) for i in range(N)]
    seed_url(cassandra_url, name, samples)
    return cassandra_url, name, {s.id: s.data for s in samples}


def via(url: str, proxy: ProxyThread, **options) -> str:
    host, port = proxy.address
    rest = url.split("//", 1)[1].split("/", 1)[1]
    extra = "&".join(f"{k}={v}" for k, v in options.items())
    return f"cassandra://{host}:{port}/{rest}" + (("&" if "?" in rest else "?") + extra if extra else "")


def upstream(url: str) -> tuple[str, int]:
    hostport = url.split("//", 1)[1].split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    return host, int(port)


def test_epoch_through_the_proxy_is_exact_and_byte_exact(cql_dataset):
    url, name, blobs = cql_dataset
    with ProxyThread(upstream(url), LinkOptions(delay=0.01)) as proxy:
        with Loader(via(url, proxy), name, batch_size=32) as loader:
            got = {}
            for batch in loader:
                for i, d in zip(batch.ids.tolist(), batch.data):
                    assert i not in got
                    got[i] = d.tobytes()
            stats = loader.stats()
    assert got == blobs
    # the proxy's round trip is felt; uvloop's clock ticks in milliseconds (a reading of 0.0199999 was seen)
    assert stats.min_latency is not None and stats.min_latency >= 0.019


def test_exactly_once_with_injected_faults_over_real_cql(cql_dataset):
    url, name, _ = cql_dataset
    faults = Faults(error=0.1, drop=0.1, hang=0.05, slow=0.1, slow_delay=0.5, seed=5)

    with ProxyThread(upstream(url), LinkOptions(delay=0.005, jitter=0.003)) as proxy:
        target = via(url, proxy)

        async def faulty():
            return FaultySource(await open_store(target, create=False), faults)

        loader = Loader(faulty, name, batch_size=25, prefetch=Prefetch(request_size=8),
                        retry=Retry(attempts=12, timeout=0.4, backoff=0.01, max_backoff=0.1),
                        hedge=Hedge(min_delay=0.05))
        with loader:
            ids = [i for b in loader for i in b.ids.tolist()]
            stats = loader.stats()
    assert Counter(ids) == Counter(range(N))
    assert stats.retries > 0 and stats.failures > 0


def test_dropped_connections_mid_epoch(cql_dataset):
    """The proxy dies mid-epoch (every connection reset) and comes back on the
    same port: the epoch still delivers every sample exactly once."""
    url, name, _ = cql_dataset
    up = upstream(url)
    first = ProxyThread(up, LinkOptions(delay=0.01)).start()
    port = first.address[1]
    target = via(url, first, request_timeout=2)
    state = {}

    def bounce():
        time.sleep(0.3)
        first.close()
        time.sleep(0.5)
        state["second"] = ProxyThread(up, LinkOptions(delay=0.01), listen=("127.0.0.1", port)).start()

    retry = Retry(attempts=40, timeout=3.0, backoff=0.05, max_backoff=0.5)
    try:
        with Loader(target, name, batch_size=10, retry=retry, prefetch=Prefetch(request_size=4, max_inflight=4)) as loader:
            it = iter(loader)
            ids = next(it).ids.tolist()
            t = threading.Thread(target=bounce)
            t.start()
            for batch in it:
                ids += batch.ids.tolist()
                time.sleep(0.01)  # keep the epoch alive across the bounce
            t.join()
            stats = loader.stats()
    finally:
        first.close()
        if "second" in state:
            state["second"].close()
    assert Counter(ids) == Counter(range(N))
    assert stats.failures > 0 or stats.retries > 0
