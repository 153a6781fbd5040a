"""What the engine does when a request does not come back whole: :class:`Recovery`, the
half of ``_engine.Run`` that handles a request's end (its latency for the tuner, or its
failure), retries with backoff until ``Retry.deadline``, hands a position that gives up to
``ErrorPolicy`` (``SampleFailed``, or ``CorruptSample`` as itself), hedges slow requests,
times out requests past ``Retry.timeout`` and, with the breaker open, probes one request at
a time. A mixin: it runs on the engine's loop, on ``Run``'s state."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from dataferry.schema import CorruptSample, StoreError

from ._retry import retryable
from ._tuner import quantile
from ._types import SampleFailed

if TYPE_CHECKING:
    from ._epoch import _Epoch, _Req

__all__ = ["Recovery"]

_INF = float("inf")


class Recovery:
    """Failures, retries, hedges, timeouts and the breaker's probe, for ``_engine.Run``."""

    def _probe(self, now: float) -> float:
        """Breaker open: one request at a time, spaced by the backoff."""
        if self._active:
            return _INF  # the probe (or a request sent before the breaker opened) is out
        if now < self._breaker.probe_at:
            return self._breaker.probe_at
        for ep in (self.current, self.ahead):
            if ep is None or ep.finished:
                continue
            while ep.retries:
                _, _, positions, attempt = heapq.heappop(ep.retries)
                positions = ep.uncovered(positions)
                if positions:
                    self._start(ep, positions, attempt, now)
                    return _INF
            positions = ep.fresh(self.request_size)
            if positions:
                self._start(ep, positions, 1, now)
                return _INF
        return _INF

    def _expire(self, now: float) -> float:
        """Cancel the requests past ``Retry.timeout`` (their ``_on_done`` sees a timeout); return
        when the next one times out (inf: none in flight)."""
        deadlines = self._deadlines
        while deadlines:
            deadline, req = deadlines[0]
            task = req.task
            if req not in self._active or task.done() or task.cancelling():
                deadlines.popleft()  # answered, or cancelled already (a hedge twin made it redundant)
                continue
            if deadline > now:
                return deadline
            deadlines.popleft()
            req.timed_out = True
            task.cancel()
        return _INF

    def _on_done(self, req: _Req, now: float) -> None:
        self._active.discard(req)
        self._blind -= req.blind
        if req.hedge:
            self._nhedge -= 1
        else:
            self._nreq -= 1
        ep = req.epoch
        twin = req.twin
        if req.reserved and twin is not None and twin.twin is req and twin in self._active:
            # what is left of a hedge pair's shared reservation goes to the twin still in flight, up to
            # what its unanswered samples need: its answers are first answers now (_on_result)
            need = sum(twin.per_sample for p in twin.all_positions() if p not in ep.completed) - twin.reserved
            if need > 0:
                moved = min(need, req.reserved)
                twin.reserved += moved
                req.reserved -= moved
        self._reserved -= req.reserved
        ep.active -= 1
        ep.reserved -= req.reserved
        req.reserved = 0
        cover = ep.cover
        for p in req.all_positions():
            if cover[p] > 1:
                cover[p] -= 1
            else:
                del cover[p]
        task = req.task
        if req.timed_out and task.cancelled():
            exc = TimeoutError(f"a request of {req.count} ids had no answer in {self.retry.timeout:g} s")
        else:
            exc = None if task.cancelled() else task.exception()
        live = ep is self.current or ep is self.ahead
        missing = ep.uncovered(req.all_positions())
        if task.cancelled() and not req.timed_out:
            pass  # a hedge twin made it redundant, or the epoch was abandoned
        elif exc is None and not missing:
            lat = now - req.start
            full = not req.hedge and req.count >= req.size
            self.link.rate_sample(now, req.start, req.sent_delivered)
            self.link.answered(lat, full, req.size, len(req.answered), req.sent_with, first=req.first - req.start)
            c = self.c
            c.request_latency = lat if c.request_latency is None else c.request_latency * 0.875 + lat * 0.125
            c.answers += 1
            c.latency_sum += lat
            c.min_latency = self.link.min_latency
            if full and len(self.link.latencies) >= 8 and c.answers % 8 == 0 and self.hedge.enabled:
                p95 = quantile(self.link.latencies, 0.95)
                self.link.hedge_after = max(self.hedge.min_delay, self.hedge.factor * p95)
        else:
            if exc is not None and not retryable(exc):
                raise exc
            if exc is None:
                exc = StoreError(f"source answered {len(missing)} of the ids it was asked for with nothing")
            self.c.failures += 1
            self.link.failed()
            self._breaker.failed(now)
        if missing and live:
            self._retry_later(ep, missing, exc or StoreError("request cancelled"), now)
        if req.twin is not None and req.twin.twin is req:
            req.twin.twin = None
        self.c.inflight = len(self._active)

    def _retry_later(self, ep: _Epoch, positions: list[int], exc: BaseException, now: float) -> None:
        again = []
        for p in positions:
            first = ep.first_fail.setdefault(p, now)
            if self.retry.gives_up(ep.attempts.get(p, 1), now - first):
                self._fail(ep, p, exc, now)
            else:
                again.append(p)
        if again:
            attempt = max(ep.attempts.get(p, 1) for p in again) + 1
            self.c.retries += len(again)
            when = now + self.retry.delay(attempt, self._rand.random())
            heapq.heappush(ep.retries, (when, next(self._seq), again, attempt))

    #: the requests sent blind are topped up each time the envelope grows this much
    TOP_UP = 1.05

    def _top_up(self, arriving: int) -> None:
        """The envelope of sample sizes (``Link.reserve_bytes``) grew while requests sent before any
        size was seen (``_Req.blind``: reserved at ``Prefetch.sample_bytes_hint``) are in flight:
        they get the difference for their unanswered samples, as far as the budget has room, so
        that the dispatcher does not fill the budget on top of samples larger than it counted
        (their excess would take the accounting past it). Requests sent since were reserved at the
        envelope; an outlier above it is not made room for. ``arriving``: the bytes of the sample
        in hand, its reservation already drawn. A hedged straggler's reservation is its hedge's."""
        per_sample = int(self.link.reserve_bytes)
        self._topped = per_sample * self.TOP_UP
        room = self.link.budget - self._reserved - self.ready_bytes - self.taken_bytes - arriving
        for req in self._active:
            if not req.blind or req.per_sample >= per_sample or (req.paired and not req.hedge):
                continue
            unanswered = len(req.positions) - len(req.answered)
            need = min(room, unanswered * per_sample - req.reserved)
            if need > 0:
                req.reserved += need
                req.epoch.reserved += need
                self._reserved += need
                room -= need
            if unanswered:  # what each answer draws: as much as there is for each (all of it, with room)
                req.per_sample = max(req.per_sample, req.reserved // unanswered)

    def _pair(self, straggler: _Req, hedge: _Req) -> None:
        """``hedge`` goes out for ``straggler``'s unanswered samples: the two become twins and share
        one reservation, the straggler's, moved to the hedge (what the hedge needs beyond it was
        reserved in ``_start``)."""
        straggler.twin, hedge.twin = hedge, straggler
        straggler.paired = hedge.paired = True
        self.c.hedges += 1
        self._nhedge += 1
        moved = min(hedge.reserved, straggler.reserved)
        straggler.reserved -= moved
        self._reserved -= moved
        straggler.epoch.reserved -= moved

    def _pair_take(self, req: _Req, take: int, positions: tuple[int, ...]) -> int:
        """What an answer to a hedge pair's request draws from the reservation (``_pair`` moved the
        straggler's to its hedge): nothing for a sample its twin answered first (it adds no bytes);
        else ``take``, with what ``req`` lacks moved over from its twin."""
        done = req.epoch.completed
        if all(p in done for p in positions):
            return 0
        twin = req.twin
        if take > req.reserved and twin is not None and twin.reserved:
            moved = min(take - req.reserved, twin.reserved)
            twin.reserved -= moved
            req.reserved += moved
        return take

    def _maybe_hedge(self, now: float) -> float:
        """Hedge requests past their deadline; return the next hedge deadline
        (inf when hedging is off, the breaker is open, or the hedge budget is spent)."""
        if not self.hedge.enabled or self._breaker.open:
            return _INF
        budget = max(1, int(self.hedge.max_fraction * self.link.window))
        hedges = self._nhedge
        heap = self._hedges
        while heap:
            deadline, _, req = heap[0]
            if req not in self._active or req.twin is not None or req.deadline != deadline:
                heapq.heappop(heap)  # answered, hedged already, or re-timed
                continue
            if hedges >= budget:
                return _INF  # the next chance comes with an answer
            if deadline > now:
                return deadline
            heapq.heappop(heap)
            ep = req.epoch
            rest = [p for p in req.all_positions() if p not in ep.completed]
            req.deadline = _INF
            # the hedge takes over what the straggler still holds for these samples (only one answer
            # per sample is kept); the budget is asked only for more than that. Asking it for the whole
            # hedge refused the hedges of a frozen Cassandra replica's stragglers once they had filled
            # the budget, and the loop waited one request timeout (deploy/OPERATIONS.md)
            extra = int(len(rest) * self.link.reserve_bytes) - req.reserved
            if rest and (extra <= 0 or self._budget_allows(extra, ep)):
                self._start(ep, rest, req.attempt, now, hedge_of=req)
                hedges += 1
        return _INF

    def _fail(self, ep: _Epoch, pos: int, exc: BaseException, now: float | None = None) -> None:
        attempts = ep.attempts.get(pos, 1)
        sid = int(ep.plan.ids_at(pos))
        first = ep.first_fail.get(pos)
        if isinstance(exc, CorruptSample):  # raised as itself: the bytes are wrong, not the store's reach
            err = exc
        else:
            err = SampleFailed(
                self.dataset, sid, attempts, exc, store=self._store,
                failing_for=None if first is None or now is None else now - first,
                down_for=None if self._breaker.down_since is None or now is None else now - self._breaker.down_since,
            )
        if self.errors.on_error == "raise" or ep.skipped_count >= self.errors.max_skipped:
            raise err from (None if err is exc else exc)
        if err is exc:  # counted when the consumer takes the skip (Loader._accept), not by a look-ahead
            self.corrupt_skips[(ep.plan.epoch, pos)] = sid
        ep.completed.add(pos)
        ep.first_fail.pop(pos, None)
        ep.attempts.pop(pos, None)
        ep.skipped_count += 1
        self._deliver(ep, pos, None, 0)
        self._hand_over(ep)
