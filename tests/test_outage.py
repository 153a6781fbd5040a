"""The engine through store outages: nothing hangs, nothing is lost or repeated.

In-process reproductions with a source that refuses every request for a while
(as a restarting server or Cassandra node does: connection refused, at once).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from dataferry.client import Hedge, Loader, MemorySource, Prefetch, Retry, SampleFailed
from dataferry.schema._errors import StoreError, StoreUnavailable


class OutageSource(MemorySource):
    """Serves normally; after ``after`` samples, refuses every request at once
    for ``down`` seconds (a store restart), then serves again."""

    def __init__(self, *a, after: int, down: float, **kw) -> None:
        super().__init__(*a, **kw)
        self.after, self.down = after, down
        self.served = 0
        self.outage_at: float | None = None
        self.outage_cpu: float | None = None  # this process's CPU seconds when the outage began
        self.refused = 0
        self.refused_at: list[float] = []  # seconds from the outage's start of each refusal

    def is_down(self) -> bool:
        if self.outage_at is None:
            if self.served < self.after:
                return False
            self.outage_at, self.outage_cpu = time.monotonic(), time.process_time()
        return time.monotonic() - self.outage_at < self.down

    async def fetch(self, dataset, ids):
        if self.is_down():
            self.refused += 1
            self.refused_at.append(time.monotonic() - self.outage_at)
            raise StoreUnavailable("test store: connection refused")
        async for r in super().fetch(dataset, ids):
            self.served += 1
            yield r


def drain_epoch(loader, timeout: float = 30.0) -> list[int]:
    """Every id of one epoch; a batch that takes over ``timeout`` s is a hang."""
    out = []
    while True:
        try:
            batch = loader.get(timeout=timeout)
        except StopIteration:
            return out
        out.extend(batch.ids.tolist())


def test_lookahead_never_starves_the_current_epoch_after_an_outage():
    """Issue 10, defect 1: dataset 9x the byte budget; during the outage the
    engine runs into the look-ahead epoch; afterwards both epochs complete."""
    n = 1500
    src = OutageSource("d", MemorySource.synthetic("d", n, size=100_000).samples.values(), after=300, down=2.0)
    loader = Loader(
        src, "d", batch_size=64,
        prefetch=Prefetch(max_bytes=16 << 20),
        retry=Retry(attempts=12, timeout=5),
    )
    with loader:
        t0 = time.monotonic()
        for epoch in range(2):
            got = drain_epoch(loader)
            assert Counter(got) == Counter(range(n)), f"epoch {epoch}"
        assert time.monotonic() - t0 < 60
    assert src.refused > 0


class CatalogOutageSource(MemorySource):
    """``read_split`` refuses for the first ``down`` seconds after creation."""

    def __init__(self, *a, down: float, **kw) -> None:
        super().__init__(*a, **kw)
        self.until = time.monotonic() + down
        self.catalog_calls = 0

    async def read_split(self, dataset, split):
        self.catalog_calls += 1
        if time.monotonic() < self.until:
            raise StoreUnavailable("test store: connection refused")
        return await super().read_split(dataset, split)


def test_default_retry_rides_out_a_restart_without_flooding_or_spinning():
    """Defect 2: with default options a 4 s outage passes unnoticed; while it
    lasts the breaker sends probes, not a flood, and the engine sleeps."""
    n = 3000
    src = OutageSource("d", MemorySource.synthetic("d", n, size=2000).samples.values(), after=500, down=4.0)
    window = 24  # the requests that can be out when the store goes down: each is refused once
    with Loader(src, "d", batch_size=50, prefetch=Prefetch(request_size=16, max_inflight=window)) as loader:
        got = []
        for batch in loader:
            got.extend(batch.ids.tolist())
        assert Counter(got) == Counter(range(n))
        # from the outage's start (a consumer that had drained every batch before it sees its
        # next one only once the store is back)
        cpu = time.process_time() - src.outage_cpu
        wall = time.monotonic() - src.outage_at
    assert wall >= 3.5
    # probes back off to Retry.max_backoff (2 s): a handful after the first instant ...
    probes = [t for t in src.refused_at if t > 0.05]
    assert len(probes) < 10, src.refused_at
    # ... plus the requests already out when it went down, at most one window (8 with this cap, 19
    # uncapped in most runs, 62 in one full run of the suite: the default window is unbounded);
    # answers still streaming from requests sent before the failures began no longer reset the
    # breaker, which let ~30 more out before it opened
    assert src.refused <= window + len(probes), src.refused_at
    assert cpu < 0.5 * wall, (cpu, wall)  # no busy loop while the store is down


def test_deadline_passes_with_an_error_naming_store_sample_and_downtime():
    src = OutageSource("d", MemorySource.synthetic("d", 200, size=100).samples.values(), after=0, down=1e9)
    src.url = "http://user:secret@store.example:8470"
    retry = Retry(deadline=1.5, backoff=0.01, max_backoff=0.2)
    with Loader(src, "d", batch_size=10, retry=retry, hedge=Hedge(enabled=False)) as loader:
        t0 = time.monotonic()
        with pytest.raises(SampleFailed) as info:
            list(loader)
        took = time.monotonic() - t0
    msg = str(info.value)
    assert 1.5 <= took < 6, took
    assert "store.example:8470" in msg and "secret" not in msg
    assert f"sample {info.value.id} of dataset 'd'" in msg
    assert "unreachable for" in msg and info.value.down_for >= 1.5
    assert "connection refused" in msg


def test_catalog_read_is_retried_through_an_outage():
    src = CatalogOutageSource("d", MemorySource.synthetic("d", 100, size=100).samples.values(), down=1.0)
    with Loader(src, "d", batch_size=10, retry=Retry(backoff=0.05, max_backoff=0.2)) as loader:
        assert sorted(i for b in loader for i in b.ids.tolist()) == list(range(100))
    assert src.catalog_calls > 1


def test_catalog_read_gives_up_at_the_deadline_naming_the_split():
    src = CatalogOutageSource("d", MemorySource.synthetic("d", 10, size=10).samples.values(), down=1e9)
    with Loader(src, "d", batch_size=10, retry=Retry(deadline=0.5, backoff=0.05, max_backoff=0.1)) as loader:
        with pytest.raises(StoreError, match="split 'all' of dataset 'd'.*connection refused"):
            list(loader)


def test_separate_outages_do_not_add_up():
    """Two outages, each shorter than the deadline but longer together: the
    budget is time per failing sample, so the second does not inherit the first."""
    class TwoOutages(MemorySource):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.t0 = time.monotonic()

        async def fetch(self, dataset, ids):
            t = time.monotonic() - self.t0
            if 0.3 < t < 1.3 or 2.0 < t < 3.0:
                raise StoreUnavailable("test store: connection refused")
            await asyncio.sleep(0.04)
            async for r in super().fetch(dataset, ids):
                yield r

    src = TwoOutages("d", MemorySource.synthetic("d", 400, size=100).samples.values())
    retry = Retry(deadline=1.5, backoff=0.05, max_backoff=0.2)
    with Loader(src, "d", batch_size=10, retry=retry, prefetch=Prefetch(request_size=4, max_inflight=2)) as loader:
        got = [i for b in loader for i in b.ids.tolist()]
        stats = loader.stats()
    assert Counter(got) == Counter(range(400))
    assert time.monotonic() - src.t0 > 3.0 and stats.failures >= 4  # both outages were met
