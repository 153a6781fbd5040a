"""A fault-injecting source for the engine's tests (a seam we own).

:class:`FaultySource` wraps any :class:`~dataferry.schema.SampleSource` and,
per request, injects errors, hangs, dropped streams and stragglers with the
probabilities in :class:`Faults`, deterministically for a seed. Tests import
it as a plain module (``from faults import Faults, FaultySource``), like
``oddfiles`` and ``server_kit``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from dataferry.client import MemorySource
from dataferry.schema import Sample, SampleNotFound, SampleSource
from dataferry.schema._errors import ConfigError, StoreUnavailable

__all__ = ["Faults", "FaultySource", "InRuns", "QueueingSource"]


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


class QueueingSource(MemorySource):
    """A :class:`~dataferry.client.MemorySource` served by ``slots`` workers,
    each taking ``service`` s per request: requests beyond the slots wait in
    line, so latency rises with load (a server or store at its limit)."""

    def __init__(self, *args, slots: int = 2, service: float = 0.02, **kw) -> None:
        super().__init__(*args, **kw)
        self.slots, self.service = slots, service
        self._sem: asyncio.Semaphore | None = None

    async def fetch(self, dataset, ids):
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.slots)
        async with self._sem:
            await asyncio.sleep(self.service)
        async for result in super().fetch(dataset, ids):
            yield result


class InRuns:
    """Wrap a source so that it answers a run at a time, as ``HttpSource.fetch_runs`` does (one
    read's records as one list): its answers grouped in runs of 1 to ``longest``, at random
    (deterministic for ``seed``). The engine then takes them through ``Run._on_results``."""

    def __init__(self, inner: SampleSource, longest: int = 9, seed: int = 0) -> None:
        self.inner = inner
        self.longest = longest
        self._rng = random.Random(seed)
        self.runs = 0

    def __getattr__(self, name):  # catalog methods pass through
        return getattr(self.inner, name)

    async def fetch(self, dataset: str, ids: Sequence[int]) -> AsyncIterator[Sample | SampleNotFound]:
        async for run in self.fetch_runs(dataset, ids):
            for result in run:
                yield result

    async def fetch_runs(self, dataset: str, ids: Sequence[int]) -> AsyncIterator[list[Sample | SampleNotFound]]:
        run: list = []
        want = self._rng.randint(1, self.longest)
        async for result in self.inner.fetch(dataset, ids):
            run.append(result)
            if len(run) >= want:
                self.runs += 1
                yield run
                run, want = [], self._rng.randint(1, self.longest)
        if run:
            self.runs += 1
            yield run
