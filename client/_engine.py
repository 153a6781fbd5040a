"""The async prefetch engine: one epoch of one rank's plan, out of order.

Data flow (everything runs on one event loop)::

    plan positions ──► dispatcher ──► request tasks ──► source.fetch(dataset, ids)
         ▲   (window, byte budget,         │ results, in completion order
         │    retries, hedges)             ▼
         └──────── retry heap ◄──── _on_result / _on_done ──► batch assembly ──► emit()

* A request carries ``request_size`` positions. Results are handled as they
  arrive, not when the request ends, so batches fill in completion order.
* The window of requests in flight starts small and grows by one per
  completed request, halves on a failed one; it is capped by
  ``Prefetch.max_inflight`` and by the byte budget (bytes reserved for
  requests in flight + bytes ready and not yet taken by the consumer).
* Exactly once: a position is completed at most once (:class:`Progress`);
  late duplicates from hedges or retries are dropped and counted.
* A failed request's unanswered positions go back with exponential backoff
  unless another request (a hedge) still covers them; after
  ``Retry.attempts`` tries, or for an unknown id, :class:`ErrorPolicy` decides.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dataferry.schema import Sample, SampleNotFound, SampleSource
from dataferry.schema._errors import DataferryError, StoreError

from ._options import ErrorPolicy, Hedge, Prefetch, Retry
from ._plan import EpochPlan
from ._progress import Progress
from ._stats import Counters

__all__ = ["Batch", "EndOfEpoch", "EpochRun", "Link", "SampleFailed", "RETRYABLE"]

#: errors worth another try; anything else is a bug and stops the epoch
RETRYABLE = (StoreError, OSError, TimeoutError, asyncio.TimeoutError, EOFError)


class SampleFailed(DataferryError):
    """A sample could not be delivered (unknown id, or retries spent)."""

    def __init__(self, dataset: str, id: int, attempts: int, cause: BaseException) -> None:
        super().__init__(f"sample {id} of dataset {dataset!r} failed after {attempts} attempt(s): {cause}")
        self.dataset = dataset
        self.id = id


@dataclass(eq=False)
class Batch:
    """One batch: encoded bytes as zero-copy uint8 views, labels and ids."""

    ids: np.ndarray  # int64
    labels: np.ndarray  # int32
    data: list[np.ndarray]  # uint8, views over the received bytes
    targets: list[bytes | None] | None
    epoch: int
    positions: np.ndarray  # positions in this rank's plan (for exact resume)
    nbytes: int
    #: positions handled without a sample (skipped by the error policy)
    skipped: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.data)


@dataclass(eq=False)
class EndOfEpoch:
    epoch: int
    #: positions handled without being delivered (skips, a dropped last batch)
    skipped: tuple[int, ...] = ()


@dataclass(eq=False)
class _Req:
    positions: dict[int, list[int]]  # id -> positions it fills
    start: float
    attempt: int
    reserved: int
    per_sample: int = 0
    hedge: bool = False
    twin: _Req | None = None
    deadline: float = float("inf")  # when to hedge it
    task: asyncio.Task | None = None
    answered: set[int] = field(default_factory=set)


class Link:
    """What the engine has learned about the link (window, sample size,
    latencies), carried from one epoch to the next so a new epoch does not
    start its window from scratch."""

    def __init__(self, prefetch: Prefetch, hedge: Hedge) -> None:
        self.window = prefetch.initial_inflight
        self.mean_bytes = float(prefetch.sample_bytes_hint)
        self.latencies: deque[float] = deque(maxlen=hedge.history)
        self.hedge_after = float("inf")


class EpochRun:
    """Fetch one epoch of ``plan`` from ``source`` and ``emit`` batches."""

    def __init__(
        self,
        source: SampleSource,
        dataset: str,
        plan: EpochPlan,
        *,
        batch_size: int,
        drop_last: bool,
        in_order: bool,
        prefetch: Prefetch,
        retry: Retry,
        hedge: Hedge,
        errors: ErrorPolicy,
        counters: Counters,
        emit: Callable[[object], None],
        done: Progress | None = None,
        link: Link | None = None,
    ) -> None:
        self.source, self.dataset, self.plan = source, dataset, plan
        self.batch_size, self.drop_last, self.in_order = batch_size, drop_last, in_order
        self.prefetch, self.retry, self.hedge, self.errors = prefetch, retry, hedge, errors
        self.c = counters
        self._emit = emit
        n = len(plan)
        self.completed = done.copy() if done is not None else Progress(n)
        self.request_size = prefetch.request_size or getattr(source, "preferred_request_size", 32)
        self.link = link if link is not None else Link(prefetch, hedge)
        self._cursor = 0
        self._retry_heap: list[tuple[float, int, list[int], int]] = []
        self._seq = itertools.count()
        self._active: set[_Req] = set()
        self._cover: dict[int, int] = {}  # position -> requests covering it
        self._attempts: dict[int, int] = {}
        self._reserved = 0
        self._wake: asyncio.Future | None = None
        self._rand = random.Random(plan.seed * 1000003 + plan.epoch)
        # batch assembly
        self._batch: list[tuple[int, Sample]] = []
        self._held: dict[int, Sample | None] = {}  # in-order mode: arrived, not yet released
        self._release = self.completed.frontier  # in-order: next position to release
        self._done_before = set(self.completed.beyond())  # delivered before a resume
        self._skipped: list[int] = []
        self._partial_bytes = 0
        self.skipped_count = 0

    # --- called from the consumer's thread via call_soon_threadsafe ----------
    def release(self, nbytes: int) -> None:
        """The consumer took a batch of ``nbytes``: the budget frees up."""
        self.c.ready_bytes -= nbytes
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    # --- the dispatcher ----------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self.completed.complete or self._active:
                self._dispatch(loop.time())
                if self.completed.complete and not self._active:
                    break
                self._wake = loop.create_future()
                waiters = {r.task for r in self._active}
                waiters.add(self._wake)
                timeout = self._next_timer(loop.time())
                done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                now = loop.time()
                for req in [r for r in self._active if r.task in done]:
                    self._on_done(req, now)
                self._maybe_hedge(now)
            self._finish()
        finally:
            for req in self._active:
                req.task.cancel()
            if self._active:
                await asyncio.gather(*(r.task for r in self._active), return_exceptions=True)
            self._active.clear()
            self.c.inflight = 0

    def _next_timer(self, now: float) -> float | None:
        t = min((r.deadline for r in self._active if not r.hedge and r.twin is None), default=float("inf"))
        if self._retry_heap:
            t = min(t, self._retry_heap[0][0])
        return None if t == float("inf") else max(0.0, t - now)

    def _budget_allows(self, est: int) -> bool:
        c = self.c
        if self._reserved + c.ready_bytes + est <= self.prefetch.max_bytes:
            return True
        # progress guarantee: nothing in flight and nothing waiting for the consumer
        return not self._active and c.ready_bytes - self._partial_bytes <= 0

    def _dispatch(self, now: float) -> None:
        n = len(self.plan)
        while len([r for r in self._active if not r.hedge]) < self.link.window:
            if self._retry_heap and self._retry_heap[0][0] <= now:
                positions, attempt = self._retry_heap[0][2], self._retry_heap[0][3]
                positions = [p for p in positions if p not in self.completed and not self._cover.get(p)]
                if not positions:
                    heapq.heappop(self._retry_heap)
                    continue
                if not self._budget_allows(int(len(positions) * self.link.mean_bytes)):
                    return
                heapq.heappop(self._retry_heap)
                self._start(positions, attempt, now)
                continue
            positions = []
            cur = self._cursor
            while cur < n and len(positions) < self.request_size:
                if cur not in self.completed:
                    positions.append(cur)
                cur += 1
            if not positions:
                self._cursor = cur
                return
            if not self._budget_allows(int(len(positions) * self.link.mean_bytes)):
                return
            self._cursor = cur
            self._start(positions, 1, now)

    def _start(self, positions: list[int], attempt: int, now: float, *, hedge_of: _Req | None = None) -> _Req:
        by_id: dict[int, list[int]] = {}
        ids = self.plan.ids
        for p in positions:
            by_id.setdefault(int(ids[p]), []).append(p)
            self._cover[p] = self._cover.get(p, 0) + 1
            self._attempts[p] = max(self._attempts.get(p, 0), attempt)
        per_sample = int(self.link.mean_bytes)
        reserved = per_sample * len(positions)
        req = _Req(by_id, now, attempt, reserved, per_sample, hedge=hedge_of is not None, twin=hedge_of)
        if hedge_of is not None:
            hedge_of.twin = req
            self.c.hedges += 1
        elif self.link.hedge_after != float("inf"):
            req.deadline = now + self.link.hedge_after
        self._reserved += reserved
        self.c.peak_bytes = max(self.c.peak_bytes, self._reserved + self.c.ready_bytes)
        req.task = asyncio.ensure_future(self._fetch(req))
        self._active.add(req)
        self.c.requests += 1
        self.c.inflight = len(self._active)
        self.c.window = self.link.window
        return req

    async def _fetch(self, req: _Req) -> None:
        async with asyncio.timeout(self.retry.timeout):
            async for result in self.source.fetch(self.dataset, list(req.positions)):
                self._on_result(req, result)

    # --- results -------------------------------------------------------------
    def _on_result(self, req: _Req, result) -> None:
        positions = req.positions.get(result.id)
        if positions is None or result.id in req.answered:
            return  # not asked for in this request; never trust it
        req.answered.add(result.id)
        take = min(req.reserved, req.per_sample * len(positions))
        req.reserved -= take
        self._reserved -= take
        if isinstance(result, SampleNotFound):
            for p in positions:
                if p not in self.completed:
                    self._fail(p, result, permanent=True)
            return
        nbytes = len(result.data)
        self.c.bytes += nbytes
        self.link.mean_bytes += (nbytes - self.link.mean_bytes) * 0.05
        first = True
        for p in positions:
            if self.completed.add(p):
                self._deliver(p, result, nbytes if first else 0)
                first = False
            else:
                self.c.duplicates += 1
        twin = req.twin
        if twin is not None and twin.task is not None and not twin.task.done():
            if all(all(q in self.completed for q in ps) for ps in twin.positions.values()):
                twin.task.cancel()

    def _on_done(self, req: _Req, now: float) -> None:
        self._active.discard(req)
        self._reserved -= req.reserved
        for ps in req.positions.values():
            for p in ps:
                self._cover[p] -= 1
                if not self._cover[p]:
                    del self._cover[p]
        task = req.task
        exc = None if task.cancelled() else task.exception()
        missing = [p for ps in req.positions.values() for p in ps if p not in self.completed and not self._cover.get(p)]
        if task.cancelled():
            pass  # a hedge twin made it redundant
        elif exc is None and not missing:
            self.link.latencies.append(now - req.start)
            self.c.rtt = now - req.start if self.c.rtt is None else self.c.rtt * 0.875 + (now - req.start) * 0.125
            self.link.window = min(self.prefetch.max_inflight, self.link.window + 1)
            if len(self.link.latencies) >= 8 and len(self.link.latencies) % 8 == 0 and self.hedge.enabled:
                p95 = float(np.percentile(np.fromiter(self.link.latencies, float), 95))
                self.link.hedge_after = max(self.hedge.min_delay, self.hedge.factor * p95)
        else:
            if exc is not None and not isinstance(exc, RETRYABLE):
                raise exc
            if exc is None:
                exc = StoreError(f"source answered {len(missing)} of the ids it was asked for with nothing")
            self.c.failures += 1
            self.link.window = max(self.prefetch.initial_inflight, self.link.window // 2)
        if missing:
            self._retry_later(missing, exc or StoreError("request cancelled"), now)
        if req.twin is not None and req.twin.twin is req:
            req.twin.twin = None
        self.c.inflight = len(self._active)

    def _retry_later(self, positions: list[int], exc: BaseException, now: float) -> None:
        again = []
        for p in positions:
            if self._attempts.get(p, 1) >= self.retry.attempts:
                self._fail(p, exc, permanent=False)
            else:
                again.append(p)
        if again:
            attempt = max(self._attempts[p] for p in again) + 1
            self.c.retries += len(again)
            when = now + self.retry.delay(attempt, self._rand.random())
            heapq.heappush(self._retry_heap, (when, next(self._seq), again, attempt))

    def _maybe_hedge(self, now: float) -> None:
        if not self.hedge.enabled:
            return
        budget = max(1, int(self.hedge.max_fraction * self.link.window))
        hedges = sum(1 for r in self._active if r.hedge)
        for req in sorted((r for r in self._active if not r.hedge and r.twin is None), key=lambda r: r.deadline):
            if req.deadline > now or hedges >= budget:
                break
            rest = [p for ps in req.positions.values() for p in ps if p not in self.completed]
            req.deadline = float("inf")
            if rest and self._budget_allows(int(len(rest) * self.link.mean_bytes)):
                self._start(rest, req.attempt, now, hedge_of=req)
                hedges += 1

    def _fail(self, pos: int, exc: BaseException, *, permanent: bool) -> None:
        attempts = self._attempts.get(pos, 1)
        sid = int(self.plan.ids[pos])
        err = SampleFailed(self.dataset, sid, attempts, exc)
        if self.errors.on_error == "raise" or self.skipped_count >= self.errors.max_skipped:
            raise err from exc
        self.completed.add(pos)
        self.skipped_count += 1
        self.c.skipped += 1
        self._deliver(pos, None, 0)

    # --- batch assembly --------------------------------------------------------
    def _deliver(self, pos: int, sample: Sample | None, nbytes: int) -> None:
        self.c.ready_bytes += nbytes
        self._partial_bytes += nbytes
        self.c.peak_bytes = max(self.c.peak_bytes, self._reserved + self.c.ready_bytes)
        if not self.in_order:
            self._take(pos, sample)
            return
        self._held[pos] = sample
        while True:
            if self._release in self._held:
                self._take(self._release, self._held.pop(self._release))
            elif self._release not in self._done_before:
                break
            self._release += 1

    def _take(self, pos: int, sample: Sample | None) -> None:
        if sample is None:
            self._skipped.append(pos)
            return
        self._batch.append((pos, sample))
        if len(self._batch) >= self.batch_size:
            self._flush()

    def _flush(self) -> None:
        items, self._batch = self._batch, []
        nbytes = sum(len(s.data) for _, s in items)
        targets = [s.target for _, s in items]
        batch = Batch(
            ids=np.fromiter((s.id for _, s in items), np.int64, len(items)),
            labels=np.fromiter((s.label for _, s in items), np.int32, len(items)),
            data=[np.frombuffer(s.data, np.uint8) for _, s in items],
            targets=targets if any(t is not None for t in targets) else None,
            epoch=self.plan.epoch,
            positions=np.fromiter((p for p, _ in items), np.int64, len(items)),
            nbytes=nbytes,
            skipped=tuple(self._skipped),
        )
        self._skipped = []
        self._partial_bytes -= nbytes
        self.c.samples += len(items)
        self.c.batches += 1
        self._emit(batch)

    def _finish(self) -> None:
        dropped: list[int] = []
        if self._batch:
            if self.drop_last:
                dropped = [p for p, _ in self._batch]
                nbytes = sum(len(s.data) for _, s in self._batch)
                self.c.ready_bytes -= nbytes
                self._partial_bytes -= nbytes
                self._batch = []
            else:
                self._flush()
        self._emit(EndOfEpoch(self.plan.epoch, tuple(self._skipped) + tuple(dropped)))
        self._skipped = []
