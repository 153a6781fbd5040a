"""Sources at seams we own: an in-memory store and a fault-injecting wrapper.

Both implement the one-method :class:`~dataferry.schema.SampleSource` seam, so
tests and benchmarks drive the real engine without a network, and can inject
errors, hangs, dropped streams and stragglers deterministically.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dataferry.schema import ALL_SPLIT, IdList, Sample, SampleNotFound, SampleSource
from dataferry.schema._errors import ConfigError, DatasetNotFound, SplitNotFound, StoreUnavailable

__all__ = ["MemorySource", "Faults", "FaultySource"]


class MemorySource:
    """Samples held in a dict. ``latency`` seconds are awaited per request
    (an emulated round trip); results come back in request order."""

    preferred_request_size = 32

    def __init__(self, dataset: str, samples: Iterable[Sample], *, latency: float = 0.0) -> None:
        self.dataset = dataset
        self.samples = {s.id: s for s in samples}
        self.latency = latency
        self.requests = 0

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
        for i in ids:
            s = self.samples.get(i) if dataset == self.dataset else None
            yield s if s is not None else SampleNotFound(dataset, i)

    async def read_split(self, dataset: str, split: str) -> IdList:
        if dataset != self.dataset:
            raise DatasetNotFound(dataset)
        if split != ALL_SPLIT:
            raise SplitNotFound(dataset, split)
        ids = np.fromiter(self.samples, np.int64, len(self.samples))
        labels = np.fromiter((s.label for s in self.samples.values()), np.int32, len(self.samples))
        return IdList(ids, labels)


@dataclass(frozen=True, slots=True)
class Faults:
    """Per-request fault probabilities (each request draws once)."""

    error: float = 0.0  #: raise StoreUnavailable before answering
    drop: float = 0.0  #: answer part of the ids, then lose the connection
    hang: float = 0.0  #: never answer (the engine's timeout must fire)
    slow: float = 0.0  #: answer after ``slow_delay`` (a straggler)
    slow_delay: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        total = self.error + self.drop + self.hang + self.slow
        if min(self.error, self.drop, self.hang, self.slow) < 0 or total > 1:
            raise ConfigError(f"fault probabilities must be >= 0 and sum to <= 1: {self}")


class FaultySource:
    """Wrap a source and inject :class:`Faults`. Counts what it injected."""

    def __init__(self, inner: SampleSource, faults: Faults) -> None:
        self.inner = inner
        self.faults = faults
        self.preferred_request_size = getattr(inner, "preferred_request_size", 32)
        self._rng = random.Random(faults.seed)
        self.injected = {"error": 0, "drop": 0, "hang": 0, "slow": 0}

    def __getattr__(self, name):  # catalog methods pass through
        return getattr(self.inner, name)

    async def fetch(self, dataset: str, ids: Sequence[int]) -> AsyncIterator[Sample | SampleNotFound]:
        f = self.faults
        r = self._rng.random()
        kind = None
        for name, p in (("error", f.error), ("drop", f.drop), ("hang", f.hang), ("slow", f.slow)):
            if r < p:
                kind = name
                break
            r -= p
        if kind:
            self.injected[kind] += 1
        if kind == "error":
            raise StoreUnavailable("injected: connection refused")
        if kind == "hang":
            await asyncio.Event().wait()
        if kind == "slow":
            await asyncio.sleep(f.slow_delay)
        keep = self._rng.randrange(len(ids)) if kind == "drop" and ids else len(ids)
        n = 0
        async for result in self.inner.fetch(dataset, ids):
            if n == keep:
                raise StoreUnavailable("injected: connection lost mid-stream")
            n += 1
            yield result
