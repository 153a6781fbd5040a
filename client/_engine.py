"""The async prefetch engine: one rank's epochs, out of order, back to back.

Data flow (everything runs on one event loop)::

    plan positions ──► dispatcher ──► request tasks ──► source.fetch(dataset, ids)
         ▲   (window, byte budget,         │ results, in completion order
         │    retries, hedges)             ▼
         └──────── retry heap ◄──── _on_result / _on_done ──► batch assembly ──► emit()

* A request carries ``request_size`` positions. Results are handled as they
  arrive, not when the request ends, so batches fill in completion order.
* The window of requests in flight (:class:`Link`) is sized by the link:
  2 x the learned bandwidth-delay product (BBR-like), starting with the
  first batch's worth and growing 2.89x per round trip (BBR's start-up gain)
  until the delivery rate levels off, then draining the queue the start-up
  left at a bottleneck (BBR's drain); it halves on a failed request, and is capped by ``Prefetch.max_inflight`` and by the byte budget
  (bytes reserved for requests in flight + bytes ready and not yet taken by
  the consumer). The request size is tuned too (:class:`_RequestSizer`).
* Exactly once: a position is completed at most once (:class:`DoneSet`);
  late duplicates from hedges or retries are dropped and counted.
* Epochs run back to back: once the current epoch has nothing new to send,
  the next epoch's positions go out (retries of the current one still come
  first). Its batches wait in the engine, inside the byte budget, until the
  current epoch's end has been emitted, so the link never drains at an
  epoch boundary and batches never mix epochs.
* The current epoch always goes first: its retries and fresh positions are
  sent before any of the look-ahead epoch's, and the look-ahead may hold at
  most half of the byte budget, so look-ahead batches can never starve the
  epoch the consumer is waiting on.
* A failed request's unanswered positions go back, in their epoch's retry
  heap, with exponential backoff unless another request (a hedge) still
  covers them. The retry budget is a time (``Retry.deadline``): a sample is
  given up, and :class:`ErrorPolicy` decides, once it has been failing for
  that long (or after ``Retry.attempts`` tries, when set); an unknown id is
  given up at once.
* A circuit breaker: after ``Retry.breaker_after`` failed requests in a row
  with no answer in between, only one request at a time (a probe) goes out,
  spaced by the backoff, until the store answers again.
* The dispatcher sleeps until the next event (an answer, a release by the
  consumer) or the next timer (a retry or probe due, a hedge); it never
  polls.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from dataferry.schema import CorruptSample, Sample, SampleNotFound, SampleSource, sample_checksum
from dataferry.schema._errors import DataferryError, PermanentStoreError, StoreError
from dataferry.schema._url import redact_url

from ._options import ErrorPolicy, Hedge, Prefetch, Retry
from ._plan import EpochPlan
from ._doneset import DoneSet
from ._stats import Counters

__all__ = ["Batch", "EndOfEpoch", "Run", "Link", "SampleFailed", "RETRYABLE", "describe_source", "retrying"]

log = logging.getLogger("dataferry.client")
#: the self-tuner's decisions (window, request size): silence them on their own
tune_log = logging.getLogger("dataferry.client.tune")
_INF = float("inf")

#: errors worth another try, but a PermanentStoreError (``retryable``); anything else is a bug and stops the epoch
RETRYABLE = (StoreError, OSError, TimeoutError, asyncio.TimeoutError, EOFError)


def retryable(exc: BaseException) -> bool:
    """Whether ``exc`` is worth another try: a RETRYABLE error that is not a PermanentStoreError
    (a certificate, a refused token, a wrong scheme: raised at once, not retried for the deadline)."""
    return isinstance(exc, RETRYABLE) and not isinstance(exc, PermanentStoreError)


def quantile(xs: Iterable[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (not empty), interpolated linearly between
    the closest ranks (numpy's default). A sort of a few hundred floats: in the
    engine's thread, among the samples' bytes, ``np.percentile`` cost 150-250 us
    a call, 0.8 us per sample at 8 answers a call."""
    s = sorted(xs)
    at = (len(s) - 1) * q
    lo = int(at)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (at - lo)


class SampleFailed(DataferryError):
    """A sample could not be delivered (unknown id, or its retry deadline passed)."""

    def __init__(
        self, dataset: str, id: int, attempts: int, cause: BaseException,
        *, store: str | None = None, failing_for: float | None = None, down_for: float | None = None,
    ) -> None:
        where = f" from {store}" if store else ""
        span = f" over {failing_for:.1f} s" if failing_for else ""
        down = f"; the store was unreachable for {down_for:.1f} s" if down_for else ""
        super().__init__(f"sample {id} of dataset {dataset!r}{where} failed after {attempts} attempt(s){span}{down}: {cause}")
        self.dataset = dataset
        self.id = id
        self.store = store
        self.failing_for = failing_for
        self.down_for = down_for


def describe_source(source: object) -> str:
    """A source's name for messages: its URL (password redacted), else its repr."""
    url = getattr(source, "url", None)
    return redact_url(url) if isinstance(url, str) and url else repr(source)


async def retrying(call, retry: Retry, what: str, store: str):
    """``await call()``, retried on store errors with ``retry``'s backoff until
    its deadline (catalog reads: a store restart passes unnoticed)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    rand = random.Random()
    attempt = 1
    while True:
        try:
            async with asyncio.timeout(retry.timeout):
                return await call()
        except RETRYABLE as exc:
            if not retryable(exc):
                raise
            if isinstance(exc, TimeoutError) and not str(exc):  # retry.timeout's own: say so
                exc = TimeoutError(f"no answer within {retry.timeout:g} s")
            failing = loop.time() - start
            if retry.gives_up(attempt, failing):
                raise StoreError(
                    f"{what} from {store} failed after {attempt} attempt(s) over {failing:.1f} s: {exc}"
                ) from exc
            if attempt == 1:
                log.warning("%s from %s failed (%s); retrying for up to %.0f s", what, store, exc, retry.deadline)
            attempt += 1
            await asyncio.sleep(retry.delay(attempt, rand.random()))


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


class _RequestSizer:
    """Ids per request from the engine's own CPU cost (``Prefetch(tune=True)``
    and no ``request_size``).

    A request has a fixed cost ``o`` (a task, a POST and its headers, a
    response to open) and a cost per sample ``c``. It starts small, so the
    first batch is spread over several requests in flight at once; then the
    event-loop thread's CPU per sample is measured over a few thousand samples
    at that size ``n`` (``c + o/n``) and at ``2n`` (``c + o/2n``), which gives
    both costs (measured once the pipe is full: a growing window costs CPU of
    its own). If ``2n`` saved less than ``SAVING`` the size goes back to
    ``n``; else it is the smallest power-of-two multiple of ``n`` past which a
    doubling would save less than ``SAVING``, within ``Link._size_cap`` (16
    requests in ``max_bytes``, 16 MiB a request or 6 MiB over a long round trip,
    1024 ids). Decided once per
    loader (a slow link may still cut it: ``Link._fit_size``).
    """

    SAVING = 0.05
    #: a measurement: PARTS parts of at least this many samples, requests and seconds each (the
    #: lowest part counts: interference from other processes only ever adds CPU)
    SAMPLES, REQUESTS, SECONDS, PARTS = 1024, 8, 0.1, 3

    def __init__(self, size: int, cap: Callable[[], int]) -> None:
        self.size = size
        self._cap = cap  # the most ids per request now (Link._size_cap), asked when deciding
        self.done = False
        self.settle = 32  # answers to let pass first (the start, or the old size's after a change)
        self._parts: list[float] = []
        self._samples = self._requests = 0
        self._cpu0: float | None = None
        self._t0 = 0.0
        self._before: float | None = None  # CPU per sample at the first size

    def answered(self, size: int, samples: int, window: float) -> tuple[int, str] | None:
        """A request of ``size`` ids came back with ``samples``: a new size and why, or None."""
        if self.done or size != self.size:
            return None
        if self.settle > 0:
            self.settle -= 1
            return None
        if self._cpu0 is None:
            self._cpu0, self._t0 = time.thread_time(), time.monotonic()
            return None
        self._samples += samples
        self._requests += 1
        if self._samples < self.SAMPLES or self._requests < self.REQUESTS:
            return None
        t = time.monotonic()
        if t - self._t0 < self.SECONDS:
            return None
        now = time.thread_time()
        self._parts.append((now - self._cpu0) / self._samples)
        self._cpu0, self._t0, self._samples, self._requests = now, t, 0, 0
        if len(self._parts) < self.PARTS:
            return None
        per_sample, self._parts, self._cpu0 = min(self._parts), [], None
        n = self.size
        upper = max(n, self._cap())
        if self._before is None:  # measured at the first size: now at twice that
            self._before = per_sample
            if n * 2 > upper:
                self.done = True
                return n, f"{n} ids per request: {per_sample * 1e6:.1f} us of CPU per sample; the byte budget allows no more"
            self.size = n * 2
            self.settle = int(window) + 1
            return self.size, f"{n} ids per request: {per_sample * 1e6:.1f} us of CPU per sample; trying {n * 2}"
        self.done = True
        a, b, small = self._before, per_sample, n // 2  # CPU per sample at n/2 and at n
        if a - b <= self.SAVING * a:
            self.size = small
            return small, (f"{n} ids per request took {b * 1e6:.1f} us of CPU per sample, {small} took "
                           f"{a * 1e6:.1f}: less than {self.SAVING:.0%} saved; back to {small}")
        # a = c + o / small, b = c + o / n: the per-request overhead o and the per-sample cost c
        overhead = (a - b) * n
        cost = max(b - (a - b), 1e-9)
        # the size past which doubling saves less than SAVING: o/(2m) < SAVING (c + o/m)
        best = overhead * (0.5 - self.SAVING) / (self.SAVING * cost)
        size = n
        while size < best and size * 2 <= upper:
            size *= 2
        self.size = size
        capped = "; the byte budget allows no more" if size * 2 > upper and size < best else ""
        return size, (f"{small} ids per request took {a * 1e6:.1f} us of CPU per sample, {n} took {b * 1e6:.1f}: "
                      f"about {overhead * 1e6:.0f} us per request and {cost * 1e6:.1f} us per sample, so "
                      f"{size} ids{capped}")


class Link:
    """What the engine has learned about the link (window, request size,
    sample size, latencies, delivery rate), kept across epochs and runs so a
    new epoch does not start from scratch.

    Tuned (``Prefetch.tune``), the window follows the link, as BBR sizes a TCP
    window: every answered request gives a delivery-rate sample (bytes
    answered over the last round trip); ``bandwidth`` is the highest over the
    last ten round trips, ``min_latency`` the lowest latency of a full-size
    request over the last 10 s, and the window may reach ``GAIN`` x
    their product (the bandwidth-delay product) in requests of
    ``request_size x mean_bytes``, within ``max_inflight`` (4096 unset) and
    ``max_bytes``. Where the link has no bottleneck yet, the delivery rate
    follows the window, so the target stays ahead of it and the window keeps
    growing by ``STARTUP_GAIN`` per round trip (``STARTUP_GAIN - 1`` requests
    per answer) until the rate levels off, then by one per answer; at the
    bottleneck the rate levels off and so does the window. The start-up
    overshoots a bottleneck: the queue it leaves is drained (BBR's drain) when
    requests shrink for a slow link (the window down to what the link holds,
    the latency floor to a request alone) and, once the rate levels off, by a
    probe if requests still take far longer than one alone. Not tuned, the
    target is ``max_inflight`` (64 unset).
    """

    #: requests allowed to queue at the bottleneck (TCP Vegas' alpha and beta); not tuned
    QUEUE_LOW, QUEUE_HIGH = 2.0, 6.0
    #: tuned, the window shrinks when more than this share of it queues (latency twice its
    #: floor): past the gain's worth. A count would make a large window at a long RTT shrink
    #: on a few ms of scheduling noise.
    SHARE_HIGH = 0.5
    #: in-flight target per bandwidth-delay product (BBR's cwnd_gain), and while the delivery
    #: rate still grows by a quarter per round trip (BBR's startup gain, 2/ln 2)
    GAIN, STARTUP_GAIN = 2.0, 2.89
    #: the lowest latency is remembered this long (BBR's min_rtt window); when it expires and the
    #: lowest since is PROBE_RISE times higher, the round trip is probed again
    MIN_LATENCY_S, PROBE_RISE = 10.0, 1.25
    #: a probe ends after this many answers of requests sent with at most MIN_WINDOW in flight
    PROBE_SAMPLES = 2
    #: the largest request the tuner makes, in bytes; over a long round trip, what one TCP
    #: connection carries in one (Linux's default tcp_rmem ceiling, 6 MiB: deploy/TRAINING.md),
    #: unless the source says otherwise (its ``max_request_bytes``: :meth:`start`)
    REQUEST_BYTES, WAN_REQUEST_BYTES = 16 << 20, 6 << 20
    #: the smallest tuned window, and the smallest start (and the fewest requests a link-bound
    #: window is cut into)
    MIN_WINDOW, MIN_START = 2, 4
    #: the link is the limit (not the engine's CPU) when the round trip is at least LINK_RTT_S and
    #: the engine's thread was on CPU less than LINK_BOUND of it
    LINK_RTT_S, LINK_BOUND = 0.01, 0.5
    #: the delivery-rate filter spans this many round trips (at least RATE_SPAN_S seconds)
    RATE_ROUNDS, RATE_SPAN_S = 10, 0.25
    #: a delivery-rate sample spans at least a round trip and this many seconds
    RATE_MIN_S = 0.02
    #: seconds between two log lines of the same kind of window decision
    LOG_EVERY = 10.0
    #: the most bytes reserved per sample in flight, in mean sample sizes (``reserve_bytes``)
    RESERVE_CAP = 3.0

    def __init__(self, prefetch: Prefetch, hedge: Hedge) -> None:
        self.prefetch = prefetch
        self.tuned = prefetch.tune
        self.window = float(prefetch.initial_inflight or self.MIN_WINDOW)
        self.request_size = prefetch.request_size or 32
        self.mean_bytes = float(prefetch.sample_bytes_hint)
        #: bytes reserved per sample in flight (``Run._budget_allows``): an upper envelope of the
        #: sizes seen (``high_bytes``: the largest, decaying towards the mean over a few thousand
        #: samples), so that requests of samples larger than the mean still fit what was reserved
        #: for them; at most RESERVE_CAP x the mean, so one outlier (a 10 MB panorama among 110 KB
        #: photos) does not shrink the window for thousands of samples (it takes the rest of its
        #: request's reservation, and may take the accounting past the budget by its excess)
        self.high_bytes = self.reserve_bytes = float(prefetch.sample_bytes_hint)
        self.latencies: deque[float] = deque(maxlen=hedge.history)  # full-size requests only
        self.min_latency: float | None = None  # the lowest of them: the round-trip estimate
        self.hedge_after = float("inf")
        self.delivered = 0  # bytes answered, ever: the delivery-rate clock
        self.bandwidth: float | None = None  # bytes/s: the highest recent delivery rate
        self._rates: deque[tuple[float, float]] = deque()  # (when, rate), rates decreasing
        self._marks: deque[tuple[float, int]] = deque()  # (when, delivered) over the last round trip
        self._mins: deque[tuple[float, float]] = deque()  # (when, latency), latencies increasing
        self._firsts: deque[tuple[float, float]] = deque()  # the same for first answers
        self.min_first: float | None = None  # the lowest latency to a first answer: the link's round trip
        self.filled = False  # the delivery rate stopped growing: the pipe is full
        self.probing = False  # holding MIN_WINDOW requests to see the round trip without our queue
        self._probe_saved, self._probe_lats = 0.0, []
        self._full_bw, self._flat_rounds, self._round_end = 0.0, 0, 0.0
        self._round_start: float | None = None
        self._round_cpu = 0.0
        #: the lowest whole-request latency in this round trip and in the last: a queue at a
        #: bottleneck delays every request, so the queue rule (tuned) reads the lowest, not each
        self._low_now = self._low_last = _INF
        self.busy: float | None = None  # the share of the last round trip the engine's thread was on CPU
        self.sizer: _RequestSizer | None = None
        self.concurrency: int | None = None  # requests the source carries at once, hedges set aside
        #: the most bytes a request carries over a long round trip (None: no limit of the source's own)
        self.wan_request_bytes: int | None = self.WAN_REQUEST_BYTES
        self.started = False
        self._logged: dict[str, float] = {}

    def start(self, batch_size: int, preferred: int | None, concurrency: int | None = None,
              hedge_share: float = 0.0, *, wan_request_bytes: int | None = WAN_REQUEST_BYTES) -> None:
        """The first run: choose the request size and the first window. ``concurrency``: the
        requests the source carries at once (``max_concurrency``, e.g. an HTTP pool's connections);
        ``wan_request_bytes``: the most one request carries over a long round trip (the source's
        ``max_request_bytes``; None: no limit of its own, as ``MemorySource``)."""
        if self.started:
            return
        self.started = True
        p = self.prefetch
        self.wan_request_bytes = wan_request_bytes
        if concurrency:
            self.concurrency = max(1, int(concurrency / (1.0 + hedge_share)))
        preferred = preferred or 32
        if p.request_size is not None:
            self.request_size = p.request_size
        elif not self.tuned:
            self.request_size = preferred
        else:
            # small first: the first batch spread over about eight requests in flight together
            self.request_size = max(4, min(preferred, -(-batch_size // 8)))
            self.sizer = _RequestSizer(self.request_size, self._size_cap)
        if p.initial_inflight is not None:
            self.window = float(p.initial_inflight)
        elif self.tuned:
            # enough requests that the first round trip fills the first batch
            first = max(self.MIN_START, -(-batch_size // self.request_size))
            self.window = float(max(1, min(first, self._cap())))
        else:
            self.window = 2.0
        self._log("start", f"window starts at {self.window:g} requests of {self.request_size} ids")

    def _size_cap(self) -> int:
        """The most ids per request the tuner may choose: 16 requests fit in ``max_bytes``, one
        is at most ``REQUEST_BYTES`` (a retry, a hedge, a timeout stay small), and at most the
        source's ``max_request_bytes`` (``WAN_REQUEST_BYTES`` unless it says) over a round trip of
        ``LINK_RTT_S`` or more; 1024."""
        most = min(self.prefetch.max_bytes / 16, self.REQUEST_BYTES)
        wan = self.min_first is not None and self.min_first >= self.LINK_RTT_S
        if wan and self.wan_request_bytes is not None:
            most = min(most, self.wan_request_bytes)
        return max(1, min(1024, int(most / self.mean_bytes)))

    def _cap(self) -> float:
        """The most requests the options allow: ``max_inflight`` and, tuned, the byte budget
        and what the source can carry at once (its ``max_concurrency``, less the hedges' share)."""
        cap = float(self.prefetch.inflight_cap)
        if self.tuned and self.concurrency is not None and self.prefetch.max_inflight is None:
            cap = min(cap, float(self.concurrency))
        if self.tuned:
            cap = min(cap, max(1.0, self.prefetch.max_bytes / (self.request_size * self.mean_bytes)))
        return cap

    def target(self) -> float:
        """Where the window may grow to: ``GAIN`` x the bandwidth-delay product, within the cap."""
        cap = self._cap()
        if not self.tuned or self.bandwidth is None or self.min_latency is None:
            return cap
        bdp = self.bandwidth * self.min_latency / (self.request_size * self.mean_bytes)
        gain = self.GAIN if self.filled else self.STARTUP_GAIN
        return max(float(self.MIN_WINDOW), min(cap, gain * bdp))

    def sending(self, now: float) -> None:
        """A request goes out at ``now``: the first starts the delivery-rate clock."""
        if not self._marks:
            self._marks.append((now, self.delivered))

    def rate_sample(self, now: float) -> None:
        """A request was answered at ``now``: sample the delivery rate over the last round trip.

        The bytes answered over at least a round trip (and ``RATE_MIN_S``), not
        per request as BBR does per packet: answers come in bursts (a loop
        that was not scheduled for a few ms handles many at once), and a burst
        over one request's latency would read as a rate the link never had.
        """
        if not self.tuned:
            return
        marks = self._marks
        marks.append((now, self.delivered))
        span = max(self.RATE_MIN_S, self.min_latency or 0.0)
        while len(marks) > 2 and marks[1][0] <= now - span:
            marks.popleft()
        then, delivered = marks[0]
        if now - then < span:
            return
        rate = (self.delivered - delivered) / (now - then)
        rates = self._rates
        span = max(self.RATE_SPAN_S, self.RATE_ROUNDS * (self.min_latency or 0.0))
        while rates and rates[-1][1] <= rate:
            rates.pop()
        rates.append((now, rate))
        while rates[0][0] < now - span:
            rates.popleft()
        self.bandwidth = rates[0][1]
        if now >= self._round_end and self.min_latency is not None:
            self._round(now)

    def _round(self, now: float) -> None:
        """Once a round trip: is the pipe full yet; does the request size fit the link."""
        cpu = time.thread_time()
        if self._round_start is not None and now > self._round_start:
            self.busy = min(1.0, (cpu - self._round_cpu) / (now - self._round_start))
        self._round_start, self._round_cpu = now, cpu
        self._round_end = now + max(self.min_latency, self.RATE_MIN_S)
        self._low_last, self._low_now = self._low_now, _INF
        self._fit_size()
        if not self.filled:
            # has the rate grown by a quarter? three times no: the pipe is full
            if self.bandwidth >= 1.25 * self._full_bw:
                self._full_bw, self._flat_rounds = self.bandwidth, 0
            else:
                self._flat_rounds += 1
                if self._flat_rounds >= 3:
                    self.filled = True
                    self._log("filled", f"delivery rate levelled off at {self.bandwidth / 1e6:,.1f} MB/s: "
                                        f"window towards {self._why(self.target())}")
                    # a request alone takes the round trip plus its transfer; far more than that from
                    # the start means the start-up window left a queue (BBR drains it)
                    alone = (self.min_first or 0.0) + self.request_size * self.mean_bytes / self.bandwidth
                    if self.min_latency > self.PROBE_RISE * 1.2 * alone:
                        self._start_probe(f"requests take {self.min_latency * 1e3:.0f} ms, one alone "
                                          f"{alone * 1e3:.0f}: a queue from the start")

    def _fit_size(self) -> None:
        """A link-bound loader (its thread mostly idle) whose window holds fewer than
        ``MIN_START`` requests: smaller requests, so the window is not one request in a
        round trip (on a slow link a large request is a burst, then a gap). A window that
        the source's concurrency caps below the bandwidth-delay product: larger ones."""
        if self.sizer is not None and self.concurrency is not None and self.bandwidth and self.min_latency:
            need = self.GAIN * self.bandwidth * self.min_latency / self.mean_bytes  # samples in flight
            size = self.request_size
            while size * self.concurrency < need and size * 2 <= self._size_cap():
                size *= 2
            if size > self.request_size:
                self.sizer.done = True
                self._resize(size, f"{self.GAIN:g} x {self.bandwidth / 1e6:,.1f} MB/s x "
                                   f"{self.min_latency * 1e3:.0f} ms needs {need:,.0f} samples in flight, and the "
                                   f"source carries {self.concurrency} requests at once")
                return
        rtt = self.min_first
        if (self.sizer is None or self.busy is None or self.busy > self.LINK_BOUND or self.request_size <= 1
                or rtt is None or rtt < self.LINK_RTT_S):
            return
        fits = self.GAIN * self.bandwidth * rtt / (self.MIN_START * self.mean_bytes)
        size = self.request_size
        while size > 1 and size > fits:
            size //= 2
        if size < self.request_size:
            self.sizer.done = True
            self._resize(size, f"the link carries {self.bandwidth / 1e6:,.1f} MB/s x {rtt * 1e3:.0f} ms "
                               f"and this thread was {self.busy:.0%} busy: {self.MIN_START} requests of {size} ids "
                               f"fit {self.GAIN:g} x that")
            # BBR's drain: the bytes in flight now are mostly the start-up's queue at the bottleneck
            # (the whole latency measured so far is that queue, not the link), so do not keep them:
            # the window comes down to what the link holds, and the latency floor to what a
            # request of this size takes alone (its round trip and its transfer)
            alone = rtt + (size - 1) * self.mean_bytes / self.bandwidth
            self._mins.clear()
            self.min_latency = self._windowed_min(self._mins, alone)
            holds = self.GAIN * self.bandwidth * alone / (size * self.mean_bytes)
            self.window = min(self.window, max(float(self.MIN_START), holds))
            self._log("drain", f"requests of {size} ids take {alone * 1e3:.0f} ms alone: window {self.window:.0f}")

    def _start_probe(self, why: str) -> None:
        """Hold ``MIN_WINDOW`` requests until a few answer: the round trip without our own queue
        (BBR's drain and ProbeRTT; the start-up window, or a standing queue, inflates latency)."""
        if self.probing:
            return
        self.probing = True
        self._probe_saved, self._probe_lats = self.window, []
        self.window = float(self.MIN_WINDOW)
        self._log("probe", f"{why}: {self.MIN_WINDOW} requests in flight for a round trip, to measure it")

    def _probed(self, latency: float, sent_with: int) -> bool:
        """During a probe: take the latency of a request sent with the window drained; True while probing."""
        if sent_with <= self.MIN_WINDOW:
            self._probe_lats.append(latency)
        if len(self._probe_lats) < self.PROBE_SAMPLES:
            return True
        self.probing = False
        was = self.min_latency
        self._mins.clear()
        self.min_latency = self._windowed_min(self._mins, min(self._probe_lats))
        self.window = max(float(self.MIN_WINDOW), min(self._probe_saved, self.target()))
        self._log("probed", f"round trip {self.min_latency * 1e3:.1f} ms (was {(was or 0) * 1e3:.1f}): "
                            f"window {self.window:.0f}, towards {self._why(self.target())}")
        return False

    def answered(
        self, latency: float, full: bool, size: int = 0, samples: int = 0, sent_with: int = 0,
        *, first: float | None = None,
    ) -> None:
        """A request of ``size`` ids came back whole after ``latency`` seconds (its first
        answer after ``first``), sent with ``sent_with`` requests in flight: size the window.

        Tuned, the window's round trip is the lowest whole latency (what a
        request occupies its slot for: Little's law), and the link's is the
        lowest ``first`` (``min_first``: a request's own transfer time is not
        the link's round trip; over a slow link a large request's latency is
        mostly that).

        It grows by ``STARTUP_GAIN - 1`` per answer (``STARTUP_GAIN`` x per round
        trip) until the pipe is full, then by one, up to :meth:`target` until
        answers start to queue: ``window * (1 -
        min_latency / latency)`` estimates how many requests wait at the
        bottleneck (the server, or the link); above ``QUEUE_HIGH`` the window
        shrinks, between the two it holds. Extra requests there would add only
        memory and latency, not throughput. Tuned, ``latency`` there is the
        lowest of this round trip and the last: a queue delays every request,
        a tail (a burst's last answers waiting for this busy thread, a
        straggler) only some, and shrinking the window would not shorten it.
        """
        p = self.prefetch
        if self.sizer is not None and samples and not self.sizer.done and self.filled:
            # measured once the window has stopped growing: a growing window costs CPU of its own
            change = self.sizer.answered(size, samples, self.window)
            if change is not None:
                self._resize(*change)
        if not full:
            return  # a short request (a retry, a hedge, an epoch's tail) says little about queueing
        self.latencies.append(latency)  # the hedge's quantile: whole requests
        if self.tuned:
            if self.probing:
                if self._probed(latency, sent_with):
                    return
            else:
                self.min_latency = self._windowed_min(self._mins, latency, probe=True)
                self.min_first = self._windowed_min(self._firsts, latency if first is None else first)
                if self.probing:
                    return
        else:
            self.min_latency = min(self.latencies)
        queued = 0.0
        if self.tuned:
            # a queue delays every request; a tail (a burst's last answers waiting for a busy
            # engine thread, a straggler) does not: judge by the lowest latency this round trip
            # and the last, so answers at the floor in each round trip mean no queue
            self._low_now = min(self._low_now, latency)
            latency = min(self._low_now, self._low_last)
        if p.adaptive and latency > 0:
            queued = self.window * (1.0 - self.min_latency / latency)
        target = self.target()
        floor = float(self.MIN_WINDOW if self.tuned else p.initial_inflight or 2)
        if self.tuned:
            # BBR's rule: grow to the target whatever the latency; Vegas' only past the gain
            low, high = _INF, max(self.QUEUE_HIGH, self.SHARE_HIGH * self.window)
        else:
            low, high = self.QUEUE_LOW, self.QUEUE_HIGH
        if queued > high:
            self.window = max(min(floor, target), self.window - 0.5)
            self._note("queueing",
                       lambda: f"answers queue ({queued:.0f} requests' worth): window down to {self.window:.0f}")
        elif self.window > target:
            self.window = max(target, self.window - 1.0)
            self._note("above", lambda: f"window down to {self.window:.0f}, towards {self._why(target)}")
        elif queued < low and self.window < target:
            # tuned, until the pipe is full: STARTUP_GAIN - 1 more per answer, so the window grows
            # by the start-up gain per round trip, as fast as the target may (BBR's startup)
            step = self.STARTUP_GAIN - 1.0 if self.tuned and not self.filled else 1.0
            self.window = min(target, self.window + step)
            self._note("growing", lambda: f"window up to {self.window:.0f}, towards {self._why(target)}")

    def _windowed_min(self, mins: deque[tuple[float, float]], latency: float, probe: bool = False) -> float:
        """The lowest latency in ``mins`` over the last ``MIN_LATENCY_S`` seconds (with
        ``probe``, a probe starts when the lowest expires and the next is higher)."""
        now = time.monotonic()
        while mins and mins[-1][1] >= latency:
            mins.pop()
        mins.append((now, latency))
        old = mins[0][1]
        if mins[0][0] >= now - self.MIN_LATENCY_S:
            return old
        while mins[0][0] < now - self.MIN_LATENCY_S:
            mins.popleft()
        if probe and mins[0][1] > self.PROBE_RISE * old:
            self._start_probe(f"latency has been above {old * 1e3:.1f} ms for {self.MIN_LATENCY_S:g} s")
        return mins[0][1]

    def _why(self, target: float) -> str:
        if self.bandwidth is None or self.min_latency is None or not self.tuned or target >= self._cap():
            return f"the cap of {target:.0f} requests ({self._cap_reason()})"
        return (f"{target:.0f} = {self.GAIN:g} x {self.bandwidth / 1e6:,.1f} MB/s x {self.min_latency * 1e3:.1f} ms "
                f"in requests of {self.request_size} ids x {self.mean_bytes / 1e3:,.0f} kB")

    def _cap_reason(self) -> str:
        p = self.prefetch
        if self.tuned and p.max_bytes / (self.request_size * self.mean_bytes) < p.inflight_cap:
            return f"max_bytes {p.max_bytes / 2**20:,.0f} MiB"
        return "max_inflight" if p.max_inflight is not None else "the default limit"

    def _resize(self, size: int, why: str) -> None:
        if size != self.request_size:
            # keep the bytes in flight; the lowest latency keeps its round trip, measured while the
            # window was small (a fresh one, measured at a large window, would include our own queue)
            self.window = max(1.0, self.window * self.request_size / size)
            if self.min_latency is not None and self.min_first is not None:
                # the transfer part of the lowest latency scales with the size
                scaled = self.min_first + max(0.0, self.min_latency - self.min_first) * size / self.request_size
                self._mins.clear()
                self.min_latency = self._windowed_min(self._mins, scaled)
            self.request_size = size
            self.latencies.clear()  # the hedge's quantile: of this size
        tune_log.info("request size %d: %s", size, why)

    def failed(self) -> None:
        floor = float(self.MIN_WINDOW if self.tuned else self.prefetch.initial_inflight or 2)
        self.window = max(floor, self.window / 2)
        self._note("failed", lambda: f"a request failed: window halved to {self.window:.0f}")

    def _note(self, kind: str, message: Callable[[], str]) -> None:
        """Log a window decision: at most one per ``LOG_EVERY`` seconds of each kind
        (this runs per answer: ``message()`` is formatted only when it is logged)."""
        if time.monotonic() - self._logged.get(kind, -_INF) >= self.LOG_EVERY:
            self._log(kind, message())

    def _log(self, kind: str, message: str) -> None:
        self._logged[kind] = time.monotonic()
        tune_log.info("%s", message)


@dataclass(eq=False)
class _Req:
    epoch: _Epoch
    #: id -> the position it fills: ints only, so the cyclic garbage collector does not track it
    #: (with thousands of requests in flight, a container per id made each full collection walk
    #: every id in flight: tens of ms a pause)
    positions: dict[int, int]
    start: float
    attempt: int
    reserved: int
    per_sample: int = 0
    size: int = 0  # the request size when it was sent: fewer ids make it short
    sent_with: int = 0  # requests in flight (not hedges) when it was sent, itself included
    first: float = 0.0  # when its first answer came
    hedge: bool = False
    twin: _Req | None = None
    deadline: float = float("inf")  # when to hedge it
    task: asyncio.Task | None = None
    answered: set[int] = field(default_factory=set)
    #: id -> its further positions, for an id that fills several (a padded plan); usually None
    extra: dict[int, tuple[int, ...]] | None = None
    count: int = 0  # positions it fills
    timed_out: bool = False  # cancelled by the deadline sweep (Retry.timeout), not by a hedge

    def all_positions(self) -> Iterable[int]:
        """Every position this request fills."""
        if self.extra is None:
            return self.positions.values()
        return itertools.chain(self.positions.values(), *self.extra.values())


class _Epoch:
    """One epoch: what is done, what is covered, its retries, and batch assembly.

    Assembly (:meth:`deliver`, :meth:`finish`) puts finished batches in
    ``outbox``; the :class:`Run` hands them to the consumer once this epoch is
    the current one. ``pending_bytes`` counts delivered bytes not yet handed
    over (the batch being filled, in-order samples held back, the outbox).
    """

    def __init__(self, plan: EpochPlan, done: DoneSet | None, *, batch_size: int, in_order: bool) -> None:
        self.plan = plan
        self.n = len(plan)
        self.batch_size, self.in_order = batch_size, in_order
        self.completed = done.copy() if done is not None else DoneSet(self.n)
        self.cursor = 0
        self.cover: dict[int, int] = {}  # position -> requests covering it
        self.attempts: dict[int, int] = {}  # position -> tries sent, for retried positions until they complete
        self.first_fail: dict[int, float] = {}  # position -> when it first failed (until it completes)
        self.retries: list[tuple[float, int, list[int], int]] = []  # heap of (due, seq, positions, attempt)
        self.active = 0  # requests in flight for this epoch
        self.reserved = 0  # bytes reserved for this epoch's requests in flight
        self.batch: list[Sample] = []  # the batch being filled, and its samples' positions beside it
        self.batch_pos: list[int] = []  # (two lists, not a tuple per sample: a tuple is one more object for the GC)
        self.held: dict[int, Sample | None] = {}  # in-order mode: arrived, not yet released
        self.release = self.completed.frontier  # in-order: next position to release
        self.done_before = set(self.completed.beyond())  # delivered before a resume
        self.skipped: list[int] = []
        self.skipped_count = 0
        self.pending_bytes = 0
        self.outbox: list[Batch] = []  # finished batches not yet handed to the consumer
        self.finished = False  # its end has been emitted

    def fresh(self, k: int) -> list[int]:
        """Up to ``k`` not-yet-sent positions, in plan order."""
        out = []
        cur = self.cursor
        while cur < self.n and len(out) < k:
            if cur not in self.completed:
                out.append(cur)
            cur += 1
        self.cursor = cur
        return out

    def uncovered(self, positions: Iterable[int]) -> list[int]:
        """Those of ``positions`` neither done nor covered by a request in flight."""
        done, cover = self.completed, self.cover
        return [p for p in positions if p not in done and not cover.get(p)]

    # --- batch assembly ----------------------------------------------------------
    def deliver(self, pos: int, sample: Sample | None, nbytes: int) -> None:
        """Position ``pos`` is done: ``sample`` (None: skipped) of ``nbytes``."""
        self.pending_bytes += nbytes
        if not self.in_order:
            if sample is None:
                self.skipped.append(pos)
                return
            batch = self.batch
            batch.append(sample)
            self.batch_pos.append(pos)
            if len(batch) >= self.batch_size:
                self._flush()
            return
        self.held[pos] = sample
        while True:
            if self.release in self.held:
                self._take(self.release, self.held.pop(self.release))
            elif self.release not in self.done_before:
                break
            self.release += 1

    def _take(self, pos: int, sample: Sample | None) -> None:
        if sample is None:
            self.skipped.append(pos)
            return
        self.batch.append(sample)
        self.batch_pos.append(pos)
        if len(self.batch) >= self.batch_size:
            self._flush()

    def _flush(self) -> None:
        samples, positions, self.batch, self.batch_pos = self.batch, self.batch_pos, [], []
        datas = [s.data for s in samples]
        targets = [s.target for s in samples]
        frombuffer, u8 = np.frombuffer, np.uint8
        self.outbox.append(Batch(
            ids=np.array([s.id for s in samples], np.int64),
            labels=np.array([s.label for s in samples], np.int32),
            data=[frombuffer(d, u8) for d in datas],
            targets=targets if any(t is not None for t in targets) else None,
            epoch=self.plan.epoch,
            positions=np.array(positions, np.int64),
            nbytes=sum(map(len, datas)),
            skipped=tuple(self.skipped),
        ))
        self.skipped = []

    def finish(self, drop_last: bool) -> tuple[EndOfEpoch, int]:
        """Flush (or drop) the last partial batch; the end marker and the bytes dropped."""
        dropped: list[int] = []
        nbytes = 0
        if self.batch:
            if drop_last:
                dropped = self.batch_pos
                nbytes = sum(len(s.data) for s in self.batch)
                self.pending_bytes -= nbytes
                self.batch, self.batch_pos = [], []
            else:
                self._flush()
        end = EndOfEpoch(self.plan.epoch, tuple(self.skipped) + tuple(dropped))
        self.skipped = []
        self.finished = True
        return end, nbytes


class Run:
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
    ) -> None:
        self.source, self.dataset = source, dataset
        self.batch_size, self.drop_last, self.in_order = batch_size, drop_last, in_order
        #: bytes in batches made and not yet taken by the consumer (and in partial batches)
        self.ready_bytes = 0
        #: bytes of the batch the consumer took last: its loop holds it until it comes back for
        #: another, so it counts in the budget until then (:meth:`release`)
        self.taken_bytes = 0
        self.prefetch, self.retry, self.hedge, self.errors = prefetch, retry, hedge, errors
        self.c = counters
        self._emit = emit
        self._next_plan = next_plan
        self.current = self._epoch(plan, done)
        self.ahead: _Epoch | None = None
        self.link = link if link is not None else Link(prefetch, hedge)
        self.link.start(batch_size, getattr(source, "preferred_request_size", None),
                        getattr(source, "max_concurrency", None), hedge.max_fraction if hedge.enabled else 0.0,
                        wan_request_bytes=getattr(source, "max_request_bytes", Link.WAN_REQUEST_BYTES))
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
        self._wake: asyncio.Future | None = None
        self._rand = random.Random(plan.seed * 1000003 + plan.epoch)
        self._ended = False
        #: what held the dispatcher back in its last round: "window", "budget" or None (for the stats)
        self._held: str | None = None
        self._consumer_epoch = plan.epoch
        self._store = describe_source(source)
        #: (epoch, position) -> id of a sample skipped as corrupt; taken by the consumer's thread
        self.corrupt_skips: dict[tuple[int, int], int] = {}
        # the circuit breaker: failed requests in a row, since when, the next probe
        self._fails_in_row = 0
        self._down_since: float | None = None
        self._probes = 0
        self._probe_at = 0.0

    # --- called from the consumer's thread via call_soon_threadsafe ----------
    def release(self, nbytes: int) -> None:
        """The consumer took a batch of ``nbytes``, and (coming back for it) let go of the one
        before: that one's bytes free up; this one's count as the batch it holds, as far as the
        budget has room for it beside the next batch and a request (a budget of two batches and
        more counts it whole; the next batch must be made whatever the budget)."""
        self.ready_bytes -= nbytes
        next_batch = max(nbytes, self.batch_size * int(self.link.reserve_bytes))
        room = self.prefetch.max_bytes - next_batch - self.request_size * int(self.link.reserve_bytes)
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
            self._nreq = self._nhedge = 0
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
        fits = self._reserved + self.ready_bytes + self.taken_bytes + est <= self.prefetch.max_bytes
        if ep is not self.current:
            # the look-ahead holds at most half the budget: the rest stays for the current epoch
            return fits and ep.reserved + self._ahead_bytes() + est <= self.prefetch.max_bytes // 2
        if fits:
            return True
        # progress guarantee for the current epoch: with none of its requests in
        # flight and nothing of it waiting for the consumer, one request may go
        return not ep.active and self.ready_bytes - self._ahead_bytes() - ep.pending_bytes <= 0

    def _ahead_bytes(self) -> int:
        """Bytes the look-ahead epoch holds (delivered, waiting for its turn)."""
        return 0 if self.ahead is None else self.ahead.pending_bytes

    def _dispatch(self, now: float) -> float:
        """Send what may go now, the current epoch first; return when to look
        again (inf: at the next event, an answer or a release)."""
        if self._fails_in_row >= self.retry.breaker_after:
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
                    self._held = "budget"
                    return True, _INF
                heapq.heappop(ep.retries)
                self._start(ep, positions, attempt, now)
                continue
            if ep.cursor >= ep.n:
                return False, ep.retries[0][0] if ep.retries else _INF
            est = int(min(self.request_size, ep.n - ep.cursor) * self.link.reserve_bytes)
            if not self._budget_allows(est, ep):
                self._held = "budget"
                return True, _INF
            positions = ep.fresh(self.request_size)
            if positions:
                self._start(ep, positions, 1, now)
        self._held = "window"
        return True, _INF

    def _probe(self, now: float) -> float:
        """Breaker open: one request at a time, spaced by the backoff."""
        if self._active:
            return _INF  # the probe (or a request sent before the breaker opened) is out
        if now < self._probe_at:
            return self._probe_at
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

    def _store_failed(self, now: float) -> None:
        """A request failed: count towards (or keep) the breaker open."""
        self._fails_in_row += 1
        if self._down_since is None:
            self._down_since = now
        n = self._fails_in_row - self.retry.breaker_after
        if n >= 0:
            if n == 0:
                log.warning(
                    "%s: %d requests in a row failed; probing it one request at a time, "
                    "retrying each sample for up to %.0f s", self._store, self._fails_in_row, self.retry.deadline,
                )
            self._probes += 1
            self._probe_at = now + self.retry.delay(self._probes + 1, self._rand.random())

    def _store_answered(self) -> None:
        if self._fails_in_row >= self.retry.breaker_after:
            down = self._loop.time() - (self._down_since or 0.0)
            log.warning("%s answers again after %.1f s", self._store, down)
        self._fails_in_row = 0
        self._down_since = None
        self._probes = 0

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
                   hedge=hedge_of is not None, twin=hedge_of, extra=extra, count=len(positions))
        if hedge_of is not None:
            hedge_of.twin = req
            self.c.hedges += 1
            self._nhedge += 1
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
        self._deadlines.append((now + self.retry.timeout, req))
        req.task = asyncio.ensure_future(self._fetch(req))
        req.task.add_done_callback(lambda _, req=req: self._task_done(req))
        self._active.add(req)
        ep.active += 1
        self.c.requests += 1
        self.c.inflight = len(self._active)
        self.c.window = int(self.link.window)
        return req

    async def _fetch(self, req: _Req) -> None:
        async for result in self.source.fetch(self.dataset, list(req.positions)):
            self._on_result(req, result)

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

    # --- results -------------------------------------------------------------
    def _on_result(self, req: _Req, result) -> None:
        # per sample: the hot path (attributes read once, no tuple for an id's one position)
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
        if not isinstance(result, SampleNotFound) and len(result.data) > take:
            take = len(result.data)  # larger than its share: the rest of the request's reservation covers it
        if take > req.reserved:
            take = req.reserved
        req.reserved -= take
        self._reserved -= take
        ep = req.epoch
        ep.reserved -= take
        if self._fails_in_row:
            self._store_answered()
        if isinstance(result, SampleNotFound):
            for p in positions:
                if p not in ep.completed:
                    self._fail(ep, p, result)
            return
        # End-to-end integrity, one place for every source: the checksum the store keeps with the
        # sample against the bytes as they arrived here (~2 us per 110 KB). Not retried: a re-read
        # gets the same stored bytes (README, "Integrity").
        checksum = result.checksum
        if checksum is not None and self.errors.verify and sample_checksum(result.data) != checksum:
            bad = CorruptSample(self.dataset, sid, self._store)
            log.error("%s", bad)
            for p in positions:
                if p not in ep.completed:
                    self._fail(ep, p, bad)
            return
        nbytes = len(result.data)
        self.c.received += nbytes
        link = self.link
        link.delivered += nbytes
        link.mean_bytes += (nbytes - link.mean_bytes) * 0.05
        if nbytes > link.high_bytes:
            link.high_bytes = float(nbytes)
        else:  # the envelope decays towards the mean (half-way in about 2,800 samples)
            link.high_bytes -= (link.high_bytes - link.mean_bytes) * 0.00025
        link.reserve_bytes = min(link.high_bytes, link.RESERVE_CAP * link.mean_bytes)
        first = True
        if ep.first_fail:  # a retried position's bookkeeping ends when it completes
            for p in positions:
                ep.first_fail.pop(p, None)
                ep.attempts.pop(p, None)
        completed = ep.completed
        for p in positions:
            if completed.add(p):
                self._deliver(ep, p, result, nbytes if first else 0)
                first = False
            else:
                self.c.duplicates += 1
        if ep.outbox:
            self._hand_over(ep)
        twin = req.twin
        if twin is not None and twin.task is not None and not twin.task.done():
            if all(q in ep.completed for q in twin.all_positions()):
                twin.task.cancel()
        if ep is self.current and ep.completed.complete:
            self._poke()  # end the epoch now, not when the last request closes

    def _on_done(self, req: _Req, now: float) -> None:
        self._active.discard(req)
        if req.hedge:
            self._nhedge -= 1
        else:
            self._nreq -= 1
        self._reserved -= req.reserved
        ep = req.epoch
        ep.active -= 1
        ep.reserved -= req.reserved
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
            self.link.rate_sample(now)
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
            self._store_failed(now)
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

    def _maybe_hedge(self, now: float) -> float:
        """Hedge requests past their deadline; return the next hedge deadline
        (inf when hedging is off, the breaker is open, or the hedge budget is spent)."""
        if not self.hedge.enabled or self._fails_in_row >= self.retry.breaker_after:
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
            if rest and self._budget_allows(int(len(rest) * self.link.reserve_bytes), ep):
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
                down_for=None if self._down_since is None or now is None else now - self._down_since,
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

    def _deliver(self, ep: _Epoch, pos: int, sample: Sample | None, nbytes: int) -> None:
        self.ready_bytes += nbytes
        held = self._reserved + self.ready_bytes + self.taken_bytes
        c = self.c
        if held > c.peak_bytes:
            c.peak_bytes = held
        ep.deliver(pos, sample, nbytes)
