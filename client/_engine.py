"""The async prefetch engine: :class:`Run` fetches one rank's epochs, out of order, back to back.

Everything runs on one event loop: plan positions go out in requests
(``source.fetch(dataset, ids)``; ``fetch_runs`` where the source answers a run at a time)
within the window (``_tuner.Link``) and the byte budget; results are handled as they arrive
(a run in one pass), each position completed once (``_epoch._Epoch``), and
full batches handed to ``emit`` in completion order (plan order with ``in_order``). The
current epoch goes first; the next epoch's requests follow once it has nothing new to send
(one epoch of look-ahead, at most half the budget). A failed request's positions are retried
with backoff until ``Retry.deadline``, then ``ErrorPolicy`` raises ``SampleFailed`` or skips;
after ``Retry.breaker_after`` failures in a row one probe at a time goes out. Slow requests
are hedged. The dispatcher sleeps until the next answer, release or timer; it never polls.
Failures, retries, hedges and timeouts: ``_recovery.Recovery``. The rules in full:
client/README.md (How data flows).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import random
from collections import deque
from collections.abc import Callable

from dataferry.schema import CorruptSample, Sample, SampleNotFound, SampleSource, sample_checksum

from ._doneset import DoneSet
from ._epoch import _Epoch, _Req
from ._options import ErrorPolicy, Hedge, Prefetch, Retry
from ._plan import EpochPlan
from ._recovery import Recovery
from ._retry import Breaker, describe_source
from ._stats import Counters
from ._tuner import Link

__all__ = ["Run"]

log = logging.getLogger("dataferry.client")
_INF = float("inf")


def _runs_of(source: SampleSource):
    """The source's ``fetch_runs`` (its answers a run at a time: ``HttpSource``), where the class
    whose ``fetch`` it uses defines both: not a subclass's or a wrapper's own ``fetch`` (faults
    injected, answers changed) bypassed for a ``fetch_runs`` inherited or passed through."""
    for klass in type(source).__mro__:
        if "fetch" in vars(klass):
            return source.fetch_runs if "fetch_runs" in vars(klass) else None
    return None


class Run(Recovery):
    """Fetch this rank's epochs from ``source`` and ``emit`` batches.

    Starts at ``plan`` (resuming after ``done`` positions); when
    ``next_plan(epoch)`` is given it carries on into the following epochs,
    one epoch of look-ahead at most, until cancelled.
    """

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
        done: DoneSet | None = None,
        link: Link | None = None,
        next_plan: Callable[[int], EpochPlan] | None = None,
        waited: Callable[[], float] | None = None,
    ) -> None:
        self.source, self.dataset = source, dataset
        self._runs = _runs_of(source)
        self.batch_size, self.drop_last, self.in_order = batch_size, drop_last, in_order
        #: bytes in batches made and not yet taken by the consumer (and in partial batches)
        self.ready_bytes = 0
        #: bytes of the batch the consumer took last: its loop holds it until it comes back for
        #: another, so it counts in the budget until then (:meth:`release`)
        self.taken_bytes = 0
        self.prefetch, self.retry, self.hedge, self.errors = prefetch, retry, hedge, errors
        self._verify = errors.verify  # read once per sample
        self.c = counters
        self._emit = emit
        self._next_plan = next_plan
        #: seconds the consumer has waited for batches so far (read on the loop; a budget that
        #: follows the link grows only while it waits)
        self._waited = waited
        self.current = self._epoch(plan, done)
        self.ahead: _Epoch | None = None
        self.link = link if link is not None else Link(prefetch, hedge)
        self.link.start(batch_size, getattr(source, "preferred_request_size", None),
                        getattr(source, "max_concurrency", None), hedge.max_fraction if hedge.enabled else 0.0,
                        wan_request_bytes=getattr(source, "max_request_bytes", Link.WAN_REQUEST_BYTES),
                        link_rtt=(lambda: getattr(source, "link_rtt", None)) if hasattr(source, "link_rtt") else None,
                        server_work=(lambda: source.server_work) if hasattr(source, "server_work") else None)
        self._seq = itertools.count()
        self._active: set[_Req] = set()
        self._finished: list[_Req] = []  # requests whose task ended, not yet handled
        self._nreq = 0  # requests in flight that are not hedges
        self._nhedge = 0
        self._hedges: list[tuple[float, int, _Req]] = []  # heap of (deadline, seq, request) to hedge
        #: (when it times out, request), in the order sent: one ``Retry.timeout`` for all, so the
        #: oldest is first and one sweep (:meth:`_expire`) times them all out, no timer per request
        self._deadlines: deque[tuple[float, _Req]] = deque()
        self._reserved = 0
        #: requests in flight sent before any size was seen, and the envelope that tops them up again
        self._blind, self._topped = 0, float(self.link.reserve_bytes) * self.TOP_UP
        self._wake: asyncio.Future | None = None
        self._rand = random.Random(plan.seed * 1000003 + plan.epoch)
        self._ended = False
        #: what held the dispatcher back in its last round: "window", "budget" or None (for the stats)
        self._held: str | None = None
        self._held_ep: _Epoch | None = None  # the epoch the budget held back, when it did
        self._consumer_epoch = plan.epoch
        self._store = describe_source(source)
        #: (epoch, position) -> id of a sample skipped as corrupt; taken by the consumer's thread
        self.corrupt_skips: dict[tuple[int, int], int] = {}
        self._breaker = Breaker(retry, self._store, self._rand)

    # --- called from the consumer's thread via call_soon_threadsafe ----------
    def release(self, nbytes: int) -> None:
        """The consumer took a batch of ``nbytes``, and (coming back for it) let go of the one
        before: that one's bytes free up; this one's count as the batch it holds, as far as the
        budget has room for it beside the next batch and a request (a budget of two batches and
        more counts it whole; the next batch must be made whatever the budget)."""
        self.ready_bytes -= nbytes
        next_batch = max(nbytes, self.batch_size * int(self.link.reserve_bytes))
        room = self.link.budget - next_batch - self.request_size * int(self.link.reserve_bytes)
        self.taken_bytes = max(0, min(nbytes, room))
        self._poke()

    @property
    def request_size(self) -> int:
        return self.link.request_size

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _task_done(self, req: _Req) -> None:
        self._finished.append(req)
        self._poke()

    # --- the dispatcher ----------------------------------------------------------
    async def run(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        try:
            while True:
                self._advance()
                if self._ended:
                    break
                now = loop.time()
                self._held = None
                wake_at = min(self._dispatch(now), self._maybe_hedge(now), self._expire(now))
                held, held_from = self._held, now
                if held == "budget" and self._held_ep is self.current and self._may_grow() \
                        and self.link.starved(now, self._waited()):
                    continue  # the budget grew: send at once
                if not self._finished:
                    # sleep until an answer, a release or the next timer: O(1) per event, whatever the window
                    self._wake = loop.create_future()
                    timer = None if wake_at == _INF else loop.call_at(wake_at, self._poke)
                    try:
                        await self._wake
                    finally:
                        if timer is not None:
                            timer.cancel()
                now = loop.time()
                if held == "window":
                    self.c.window_full += now - held_from
                elif held == "budget":
                    self.c.budget_full += now - held_from
                finished, self._finished = self._finished, []
                for req in finished:
                    if req in self._active:
                        self._on_done(req, now)
        finally:
            for req in self._active:
                req.task.cancel()
            if self._active:
                await asyncio.gather(*(r.task for r in self._active), return_exceptions=True)
            self._active.clear()
            self._hedges.clear()
            self._deadlines.clear()
            self._nreq = self._nhedge = self._blind = 0
            self.c.inflight = 0

    def _advance(self) -> None:
        """End finished epochs, in order, and promote the look-ahead; the
        look-ahead is at most one epoch beyond the consumer's."""
        while True:
            cur = self.current
            if cur.completed.complete and not cur.finished:
                end, dropped = cur.finish(self.drop_last)
                self.ready_bytes -= dropped
                self._hand_over(cur)
                self._emit(end)
            if not cur.finished:
                return
            if self.ahead is None:
                if self._next_plan is None:
                    self._ended = True
                    return
                self.ahead = self._make_ahead()
                if self.ahead is None:
                    return  # the consumer is a whole epoch behind: wait for it
            self.current, self.ahead = self.ahead, None
            self._hand_over(self.current)

    def _epoch(self, plan: EpochPlan, done: DoneSet | None = None) -> _Epoch:
        return _Epoch(plan, done, batch_size=self.batch_size, in_order=self.in_order)

    def _hand_over(self, ep: _Epoch) -> None:
        """Emit ``ep``'s finished batches, if it is the current epoch."""
        if ep is self.current and ep.outbox:
            for batch in ep.outbox:
                ep.pending_bytes -= batch.nbytes
                self._emit(batch)
            ep.outbox = []

    def _make_ahead(self) -> _Epoch | None:
        epoch = self.current.plan.epoch + 1
        if self._next_plan is None or epoch > self._consumer_epoch + 1:
            return None
        return self._epoch(self._next_plan(epoch))

    def consumer_at(self, epoch: int) -> None:
        """The consumer moved on to ``epoch`` (called on the loop)."""
        self._consumer_epoch = epoch
        self._poke()

    def _budget_allows(self, est: int, ep: _Epoch) -> bool:
        link = self.link  # before any size is seen, samples up to RESERVE_CAP x the hint fit the budget
        budget = link.budget if link.delivered else int(link.budget / link.RESERVE_CAP)
        fits = self._reserved + self.ready_bytes + self.taken_bytes + est <= budget
        if ep is not self.current:
            # the look-ahead holds at most half the budget: the rest stays for the current epoch
            return fits and ep.reserved + self._ahead_bytes() + est <= budget // 2
        if fits:
            return True
        # progress guarantee for the current epoch: with none of its requests in
        # flight and nothing of it waiting for the consumer, one request may go
        return not ep.active and self.ready_bytes - self._ahead_bytes() - ep.pending_bytes <= 0

    def _may_grow(self) -> bool:
        """The budget may grow (``Link.starved`` judges whether the consumer starves, and a fixed
        budget never does): what holds it is mostly in flight (bytes piled up ready, as behind one
        slow sample in input order, would not come sooner with more)."""
        return self._waited is not None and self.ready_bytes - self._ahead_bytes() <= self.link.budget // 4

    def _ahead_bytes(self) -> int:
        """Bytes the look-ahead epoch holds (delivered, waiting for its turn)."""
        return 0 if self.ahead is None else self.ahead.pending_bytes

    def _dispatch(self, now: float) -> float:
        """Send what may go now, the current epoch first; return when to look
        again (inf: at the next event, an answer or a release)."""
        if self._breaker.open:
            return self._probe(now)
        cur = self.current
        wake = _INF
        if not cur.finished:
            blocked, wake = self._feed(cur, now)
            if blocked or cur.cursor < cur.n:
                return wake
        if self.ahead is None:
            self.ahead = self._make_ahead()
        if self.ahead is not None:
            wake = min(wake, self._feed(self.ahead, now)[1])
        return wake

    def _feed(self, ep: _Epoch, now: float) -> tuple[bool, float]:
        """Send ``ep``'s due retries, then its fresh positions, while the window
        and the budget allow. Returns (blocked by window or budget, next retry due)."""
        while self._nreq < self.link.window:
            if ep.retries and ep.retries[0][0] <= now:
                _, _, positions, attempt = ep.retries[0]
                positions = ep.uncovered(positions)
                if not positions:
                    heapq.heappop(ep.retries)
                    continue
                if not self._budget_allows(int(len(positions) * self.link.reserve_bytes), ep):
                    self._held, self._held_ep = "budget", ep
                    return True, _INF
                heapq.heappop(ep.retries)
                self._start(ep, positions, attempt, now)
                continue
            if ep.cursor >= ep.n:
                return False, ep.retries[0][0] if ep.retries else _INF
            est = int(min(self.request_size, ep.n - ep.cursor) * self.link.reserve_bytes)
            if not self._budget_allows(est, ep):
                self._held, self._held_ep = "budget", ep
                return True, _INF
            positions = ep.fresh(self.request_size)
            if positions:
                self._start(ep, positions, 1, now)
        self._held = "window"
        return True, _INF

    def _start(self, ep: _Epoch, positions: list[int], attempt: int, now: float, *, hedge_of: _Req | None = None) -> _Req:
        sids = ep.plan.ids_at(positions).tolist()
        by_id = dict(zip(sids, positions))
        extra: dict[int, tuple[int, ...]] | None = None
        if len(by_id) < len(positions):  # an id fills several positions: the first in by_id
            by_id, extra = {}, {}
            for sid, p in zip(sids, positions):
                if sid in by_id:
                    extra[sid] = (*extra.get(sid, ()), p)
                else:
                    by_id[sid] = p
        cover = ep.cover
        for p in positions:
            cover[p] = cover.get(p, 0) + 1
        if attempt > 1:  # first tries are not recorded: a position absent from ``attempts`` is on its first
            attempts = ep.attempts
            for p in positions:
                if attempts.get(p, 1) < attempt:
                    attempts[p] = attempt
        per_sample = int(self.link.reserve_bytes)
        reserved = per_sample * len(positions)
        req = _Req(ep, by_id, now, attempt, reserved, per_sample, size=self.request_size,
                   hedge=hedge_of is not None, extra=extra, count=len(positions), blind=not self.link.delivered)
        self._blind += req.blind
        if hedge_of is not None:
            self._pair(hedge_of, req)  # twins, sharing the straggler's reservation
        else:
            self._nreq += 1
            req.sent_with = self._nreq
            if self.link.hedge_after != _INF:
                req.deadline = now + self.link.hedge_after
                heapq.heappush(self._hedges, (req.deadline, next(self._seq), req))
        self._reserved += reserved
        ep.reserved += reserved
        self.c.peak_bytes = max(self.c.peak_bytes, self._reserved + self.ready_bytes + self.taken_bytes)
        self.link.sending(now)
        req.sent_delivered = self.link.delivered
        self._deadlines.append((now + self.retry.timeout, req))
        req.task = asyncio.ensure_future(self._fetch(req))
        req.task.add_done_callback(lambda _, req=req: self._task_done(req))
        self._active.add(req)
        ep.active += 1
        self.c.requests += 1
        self.c.inflight = len(self._active)
        self.c.window = int(self.link.window)
        self.c.budget = self.link.budget
        return req

    async def _fetch(self, req: _Req) -> None:
        if self._runs is not None:
            async for run in self._runs(self.dataset, list(req.positions)):
                self._on_results(req, run)
        else:
            async for result in self.source.fetch(self.dataset, list(req.positions)):
                self._on_result(req, result)

    def _on_results(self, req: _Req, results: list) -> None:
        """A run of answers to ``req`` (``fetch_runs``: what one read completed): what
        :meth:`_on_result` does for each, its bookkeeping summed over the run (no call and no
        attribute reads per sample). A request whose answers are not each one new position
        out of order (a hedge pair, a padded plan, in-order assembly, sizes not seen yet, a
        retried position), and each answer that is not a sample to take as it is (not found, a
        checksum to check), go through :meth:`_on_result`."""
        ep = req.epoch
        if req.paired or req.extra is not None or ep.in_order or self._blind or ep.first_fail:
            for result in results:
                self._on_result(req, result)
            return
        positions, answered, verify = req.positions, req.answered, self._verify
        first, slow = not answered, None
        per_sample, reserved = req.per_sample, req.reserved
        c = self.c
        held = self._reserved + self.ready_bytes + self.taken_bytes
        peak = c.peak_bytes
        completed, batch, batch_pos, size = ep.completed, ep.batch, ep.batch_pos, ep.batch_size
        add = completed.add
        taken = got = dup = 0
        sizes: list[int] = []
        for result in results:
            sid = result.id
            pos = positions.get(sid)
            if pos is None or sid in answered:
                continue  # not asked for in this request, or answered already; never trust it
            if type(result) is not Sample or (verify and result.checksum is not None):
                if slow is None:
                    slow = []
                slow.append(result)
                continue
            answered.add(sid)
            nbytes = len(result.data)
            take = nbytes if nbytes > per_sample else per_sample
            if take > reserved:
                take = reserved
            reserved -= take
            taken += take
            held -= take
            sizes.append(nbytes)
            if add(pos):
                got += nbytes
                held += nbytes
                if held > peak:
                    peak = held
                batch.append(result)
                batch_pos.append(pos)
                if len(batch) >= size:
                    ep.pending_bytes += got
                    self.ready_bytes += got
                    got = 0
                    ep._flush()
                    batch, batch_pos = ep.batch, ep.batch_pos
            else:
                dup += 1
        if sizes:
            if first:
                req.first = self._loop.time()
            breaker = self._breaker
            if breaker.fails and req.start >= breaker.down_since:
                breaker.answered(self._loop.time())  # as _on_result: the store answers again
            req.reserved = reserved
            self._reserved -= taken
            ep.reserved -= taken
            c.received += sum(sizes)
            c.duplicates += dup
            c.peak_bytes = peak
            self.ready_bytes += got
            ep.pending_bytes += got
            self.link.arrived(sizes)
        for result in slow or ():
            self._on_result(req, result)
        if ep.outbox:
            self._hand_over(ep)
        if ep is self.current and completed.frontier >= completed.n:
            self._poke()  # end the epoch now, not when the last request closes

    # --- results -------------------------------------------------------------
    def _on_result(self, req: _Req, result) -> None:
        # per sample: the hot path (attributes read once, no tuple for an id's one position; one
        # position in any order, the common case, is delivered inline, not through _deliver and deliver)
        sid = result.id
        pos = req.positions.get(sid)
        answered = req.answered
        if pos is None or sid in answered:
            return  # not asked for in this request, or answered already; never trust it
        if not answered:
            req.first = self._loop.time()
        answered.add(sid)
        extra = req.extra
        positions = (pos,) if extra is None or sid not in extra else (pos, *extra[sid])
        take = req.per_sample * len(positions)
        missing = isinstance(result, SampleNotFound)
        if not missing:
            data = result.data
            nbytes = len(data)
            if nbytes > take:
                take = nbytes  # larger than its share: the rest of the request's reservation covers it
        if req.paired:  # a hedge pair shares one reservation: _recovery.Recovery._pair_take
            take = self._pair_take(req, take, positions)
        if take > req.reserved:
            take = req.reserved
        req.reserved -= take
        self._reserved -= take
        ep = req.epoch
        ep.reserved -= take
        breaker = self._breaker
        if breaker.fails and req.start >= breaker.down_since:
            # the store answered a request sent since the failures began; a request sent before
            # (still streaming) says nothing of now, and would let a flood out before the breaker opens
            breaker.answered(self._loop.time())
        if missing:
            for p in positions:
                if p not in ep.completed:
                    self._fail(ep, p, result)
            return
        # End-to-end integrity, one place for every source: the checksum the store keeps with the
        # sample against the bytes as they arrived here (HttpSource's decoder checked a sample on
        # arrival and passed it on without its sum if it matched). Not retried: a re-read gets the
        # same stored bytes (README, "Integrity").
        checksum = result.checksum
        if checksum is not None and self._verify and sample_checksum(data) != checksum:
            bad = CorruptSample(self.dataset, sid, self._store)
            log.error("%s", bad)
            for p in positions:
                if p not in ep.completed:
                    self._fail(ep, p, bad)
            return
        c = self.c
        c.received += nbytes
        link = self.link
        link.arrived((nbytes,))
        if self._blind and link.reserve_bytes > self._topped:  # requests in flight were reserved for less
            self._top_up(nbytes)
        if ep.first_fail:  # a retried position's bookkeeping ends when it completes
            for p in positions:
                ep.first_fail.pop(p, None)
                ep.attempts.pop(p, None)
        completed = ep.completed
        if len(positions) == 1 and not ep.in_order:  # what _deliver and ep.deliver do, inline
            if completed.add(pos):
                self.ready_bytes += nbytes
                held = self._reserved + self.ready_bytes + self.taken_bytes
                if held > c.peak_bytes:
                    c.peak_bytes = held
                ep.pending_bytes += nbytes
                batch = ep.batch
                batch.append(result)
                ep.batch_pos.append(pos)
                if len(batch) >= ep.batch_size:
                    ep._flush()
            else:
                c.duplicates += 1
        else:
            first = True
            for p in positions:
                if completed.add(p):
                    self._deliver(ep, p, result, nbytes if first else 0)
                    first = False
                else:
                    c.duplicates += 1
        if ep.outbox:
            self._hand_over(ep)
        twin = req.twin
        if twin is not None and twin.task is not None and not twin.task.done():
            if all(q in completed for q in twin.all_positions()):
                twin.task.cancel()
        if ep is self.current and completed.frontier >= completed.n:
            self._poke()  # end the epoch now, not when the last request closes

    def _deliver(self, ep: _Epoch, pos: int, sample: Sample | None, nbytes: int) -> None:
        self.ready_bytes += nbytes
        held = self._reserved + self.ready_bytes + self.taken_bytes
        c = self.c
        if held > c.peak_bytes:
            c.peak_bytes = held
        ep.deliver(pos, sample, nbytes)
