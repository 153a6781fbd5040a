"""The engine at a long round trip (issue 13: 200 ms at 95% of the 0 ms rate), on the real engine.

Sources are :class:`MemorySource` (a latency per request, optionally an emulated bottleneck);
the assertions are about sizes, counts and exact-once delivery, never about time.
"""

from __future__ import annotations

import time
from collections import Counter

from dataferry.client import Hedge, Loader, MemorySource, Prefetch
from dataferry.client._engine import Link
from dataferry.schema import Sample

NO_HEDGE = Hedge(enabled=False)


def shared(n: int, size: int, distinct: int = 8) -> list[Sample]:
    """``n`` samples of ``size`` bytes sharing ``distinct`` payloads (large samples, little memory)."""
    blobs = [bytes([k]) * size for k in range(distinct)]
    return [Sample(i, i % 10, blobs[i % distinct]) for i in range(n)]


class Costly(MemorySource):
    """Each request costs ``cpu`` seconds of the engine thread (a per-request overhead worth
    amortizing over larger requests), and its sizes are recorded."""

    def __init__(self, *a, cpu: float, **kw):
        super().__init__(*a, **kw)
        self.cpu = cpu
        self.sizes: Counter[int] = Counter()

    async def fetch(self, dataset, ids):
        self.sizes[len(ids)] += 1
        end = time.thread_time() + self.cpu
        while time.thread_time() < end:
            pass
        async for r in super().fetch(dataset, ids):
            yield r


def tuned_size(src: MemorySource, n: int, epochs: int) -> tuple[int, Counter[int]]:
    with Loader(src, "d", batch_size=64, prefetch=Prefetch(max_bytes=1 << 30), hedge=NO_HEDGE) as loader:
        got: list[int] = []
        for _ in range(epochs):
            for batch in loader:
                got.extend(batch.ids.tolist())
        size = loader._link.request_size
    assert Counter(got) == Counter({i: epochs for i in range(n)})
    return size, src.sizes


def test_a_source_without_a_per_request_byte_limit_gets_larger_requests_over_a_long_round_trip():
    # 20 ms a request (a long round trip: the HTTP path caps a request at 6 MiB there, one TCP
    # window), 100 kB samples, 1 ms of CPU a request: the sizer wants requests as large as allowed.
    # MemorySource has no connection: only the engine's own 16 MiB a request applies (128 ids),
    # not 6 MiB (32 ids)
    n = 12288
    size, sizes = tuned_size(Costly("d", shared(n, 100_000), latency=0.02, cpu=0.001), n, 2)
    assert size == 128, (size, sizes)
    assert sizes[128] > 10, sizes
    assert MemorySource.max_request_bytes is None


class Plain:
    """A source that says nothing about its requests' bytes (as HttpSource and the stores)."""

    def __init__(self, inner: Costly) -> None:
        self.inner, self.sizes = inner, inner.sizes

    def fetch(self, dataset, ids):
        return self.inner.fetch(dataset, ids)

    async def read_split(self, dataset, split):
        return await self.inner.read_split(dataset, split)


def test_a_source_that_says_nothing_keeps_the_long_round_trip_cap():
    # no max_request_bytes attribute (HttpSource, a store): today's 6 MiB a request over a long
    # round trip, 62 ids of 100 kB, so 32 in powers of two from batch / 8
    n = 12288
    src = Plain(Costly("d", shared(n, 100_000), latency=0.02, cpu=0.001))
    assert not hasattr(src, "max_request_bytes")
    size, sizes = tuned_size(src, n, 2)
    assert size == 32, (size, sizes)
    assert max(sizes) <= Link.WAN_REQUEST_BYTES // 100_000, sizes
