"""An in-memory source: the smallest implementation of the seam we own.

:class:`MemorySource` implements the one-method
:class:`~dataferry.schema.SampleSource` seam, so tests, benchmarks and your own
experiments drive the real engine without a network. (The fault-injecting
wrapper the tests use lives in ``tests/faults.py``: it is a test tool.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence

import numpy as np

from .._errors import ConfigError, DatasetNotFound, SampleNotFound, SplitNotFound
from .._model import ALL_SPLIT, IdList, Sample

__all__ = ["MemorySource"]


class MemorySource:
    """Samples held in a dict. ``latency`` seconds are awaited per request
    (an emulated round trip); results come back in request order.

    ``rate`` (bytes/s; None: unlimited) emulates a link's bottleneck without
    sockets: after its round trip, each sample's bytes take ``len / rate``
    seconds on one link shared by every request in flight, first come first
    served, sample by sample (so concurrent requests share it as TCP flows
    do, and requests beyond the bandwidth-delay product queue and see their
    latency grow).
    """

    preferred_request_size = 32
    #: the most bytes one request should carry over a long round trip (the engine's
    #: ``Link``): a source says it when it has a limit of its own per request (without the
    #: attribute: 6 MiB, what one TCP connection carries in a round trip). None: no such limit
    #: (no connection here), so the tuner may grow requests to its own 16 MiB
    max_request_bytes: int | None = None

    def __init__(
        self, dataset: str, samples: Iterable[Sample], *, latency: float = 0.0, rate: float | None = None,
    ) -> None:
        if latency < 0:
            raise ConfigError(f"MemorySource latency must be >= 0 seconds, not {latency}")
        if rate is not None and rate <= 0:
            raise ConfigError(f"MemorySource rate must be > 0 bytes/s (or None: unlimited), not {rate}")
        self.dataset = dataset
        self.samples = {s.id: s for s in samples}
        self.latency = latency
        self.rate = rate
        self.requests = 0
        self._link_free = 0.0  # when the emulated link has sent everything queued on it

    @classmethod
    def synthetic(cls, dataset: str, n: int, *, size: int = 1024, classes: int = 10, seed: int = 0, **kw) -> MemorySource:
        """``n`` samples of ``size`` random bytes each (ids 0..n-1)."""
        rng = np.random.default_rng(seed)
        blob = rng.integers(0, 256, size * n, dtype=np.uint8).tobytes()
        return cls(dataset, (Sample(i, i % classes, blob[i * size : (i + 1) * size]) for i in range(n)), **kw)

    async def fetch(self, dataset: str, ids: Sequence[int]) -> AsyncIterator[Sample | SampleNotFound]:
        self.requests += 1
        if self.latency:
            await asyncio.sleep(self.latency)
        loop = asyncio.get_running_loop() if self.rate else None
        for i in ids:
            s = self.samples.get(i) if dataset == self.dataset else None
            if loop is not None and s is not None:
                now = loop.time()
                self._link_free = max(self._link_free, now) + len(s.data) / self.rate
                await asyncio.sleep(self._link_free - now)
            yield s if s is not None else SampleNotFound(dataset, i)

    async def read_split(self, dataset: str, split: str) -> IdList:
        if dataset != self.dataset:
            raise DatasetNotFound(dataset)
        if split != ALL_SPLIT:
            raise SplitNotFound(dataset, split)
        ids = np.fromiter(self.samples, np.int64, len(self.samples))
        labels = np.fromiter((s.label for s in self.samples.values()), np.int32, len(self.samples))
        return IdList(ids, labels)
