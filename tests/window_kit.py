"""What the window tests share (``test_window``, ``test_window_long_rtt``): sources
that record what the engine asks of them, and the epochs a loader yields."""

from __future__ import annotations

import time
from collections import Counter

from dataferry.client import Hedge, MemorySource
from dataferry.schema import Sample

NO_HEDGE = Hedge(enabled=False)


class Recording(MemorySource):
    """Counts requests in flight (peak) and the sizes asked for."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.inflight = self.peak = 0
        self.sizes: Counter[int] = Counter()
        self.started_before_first_answer: int | None = None
        self._started = 0

    async def fetch(self, dataset, ids):
        self.inflight += 1
        self._started += 1
        self.peak = max(self.peak, self.inflight)
        self.sizes[len(ids)] += 1
        try:
            first = True
            async for r in super().fetch(dataset, ids):
                if first and self.started_before_first_answer is None:
                    self.started_before_first_answer = self._started
                first = False
                yield r
        finally:
            self.inflight -= 1


class Overhead(Recording):
    """Each request costs ``cpu`` seconds of the engine thread's CPU (a heavy request path)."""

    def __init__(self, *a, cpu: float, **kw):
        super().__init__(*a, **kw)
        self.cpu = cpu

    async def fetch(self, dataset, ids):
        end = time.thread_time() + self.cpu
        while time.thread_time() < end:
            pass
        async for r in super().fetch(dataset, ids):
            yield r


def shared(n: int, size: int, distinct: int = 8) -> list[Sample]:
    """``n`` samples of ``size`` bytes sharing ``distinct`` payloads (large samples, little memory)."""
    blobs = [bytes([k]) * size for k in range(distinct)]
    return [Sample(i, i % 10, blobs[i % distinct]) for i in range(n)]


def samples(n: int, size: int):
    return MemorySource.synthetic("d", n, size=size).samples.values()


def epochs(loader, count: int) -> list[int]:
    ids = []
    for _ in range(count):
        for batch in loader:
            ids.extend(batch.ids.tolist())
    return ids
