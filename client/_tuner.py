"""The window and request-size tuner: :class:`Link`, what the engine has learned about the
link (window, request size, sample size, latencies, delivery rate), kept across epochs.

Tuned (``Prefetch(tune=True)``), the window follows the link as BBR sizes a TCP window
(2 x the bandwidth-delay product, a start-up gain, drain, ProbeRTT; Vegas' queue rule), and
:class:`_RequestSizer` picks the ids per request for samples per wall second at the least CPU.
The engine (``_engine.Run``) calls :meth:`Link.start` once, then :meth:`Link.sending`,
:meth:`Link.answered` and :meth:`Link.failed` per request, and reads ``window``,
``request_size``, ``reserve_bytes`` and ``hedge_after``. Decisions are logged at INFO to
``dataferry.client.tune``. The rules and their measurements: client/README.md (Window).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

from ._options import Hedge, Prefetch
from ._sizer import _RequestSizer

__all__ = ["Link", "quantile"]

#: the self-tuner's decisions (window, request size): silence them on their own
tune_log = logging.getLogger("dataferry.client.tune")
_INF = float("inf")


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


class Link:
    """What the engine has learned about the link (window, request size,
    sample size, latencies, delivery rate), kept across epochs and runs so a
    new epoch does not start from scratch.

    Tuned (``Prefetch.tune``), the window follows the link, as BBR sizes a TCP
    window: every answered request gives a delivery-rate sample (bytes
    answered over its lifetime, at least a round trip); ``bandwidth`` is the highest over the
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
    #: tuned, the least window over a short link (``link_round_trip`` under SHORT_LINK_S; a loaded
    #: machine's loopback reads 10-15 ms): latency there is the server at work, not a link's queue
    LOCAL_WINDOW, SHORT_LINK_S = 8, 0.02
    #: the link is the limit (not the engine's CPU) when the round trip is at least LINK_RTT_S and
    #: the engine's thread was on CPU less than LINK_BOUND of it
    LINK_RTT_S, LINK_BOUND = 0.01, 0.5
    #: the delivery-rate filter spans this many round trips (at least RATE_SPAN_S seconds)
    RATE_ROUNDS, RATE_SPAN_S = 10, 0.25
    #: a delivery-rate sample spans at least a round trip and this many seconds
    RATE_MIN_S = 0.02
    #: seconds between two log lines of the same kind of window decision
    LOG_EVERY = 10.0
    #: the least time between two looks at whether the loop starves (and at least a round trip),
    #: and the share of it the loop must have waited for the byte budget to grow
    BUDGET_EVERY_S = 0.05
    STARVED_SHARE = 0.1
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
        #: the byte budget now (``Run._budget_allows``): ``Prefetch.max_bytes``, or following the link
        self.budget = prefetch.start_bytes
        self._starve_mark: tuple[float | None, float] = (None, 0.0)  # (when, loop's wait then): last look
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
        self._start_samples = 0.0  # tuned: the start window's samples (``_start_floor``)
        self._link_rtt: Callable[[], float | None] | None = None
        self._logged: dict[str, float] = {}

    def start(self, batch_size: int, preferred: int | None, concurrency: int | None = None,
              hedge_share: float = 0.0, *, wan_request_bytes: int | None = WAN_REQUEST_BYTES,
              link_rtt: Callable[[], float | None] | None = None,
              server_work: Callable[[], tuple[float, int]] | None = None) -> None:
        """The first run: choose the request size and the first window. ``concurrency``: the
        requests the source carries at once (``max_concurrency``, e.g. an HTTP pool's connections);
        ``wan_request_bytes``: the most one request carries over a long round trip (the source's
        ``max_request_bytes``; None: no limit of its own, as ``MemorySource``); ``link_rtt``: the
        link's own round trip as the source measures it (a request's time less the server's, from
        the service's Server-Timing header; ``HttpSource.link_rtt``), None where it cannot;
        ``server_work``: the server's CPU seconds and samples answered so far, for the request
        sizer (``HttpSource.server_work``), None where the source does not tell them."""
        if self.started:
            return
        self.started, p = True, self.prefetch
        self.wan_request_bytes, self._link_rtt = wan_request_bytes, link_rtt
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
            self.sizer = _RequestSizer(self.request_size, self._size_cap, lambda: self._size_cap(False),
                                       self.link_round_trip, server_work, self.link_fits)
        if p.initial_inflight is not None:
            self.window = float(p.initial_inflight)
        elif self.tuned:
            # enough requests that the first round trip fills the first batch
            first = max(self.MIN_START, -(-batch_size // self.request_size))
            self.window = float(max(1, min(first, self._cap())))
            self._start_samples = self.window * self.request_size
        else:
            self.window = 2.0
        self._log("start", f"window starts at {self.window:g} requests of {self.request_size} ids")

    def _size_cap(self, long_link: bool = True) -> int:
        """The most ids per request the tuner may choose: 16 requests fit in ``max_bytes``, one
        is at most ``REQUEST_BYTES`` (a retry, a hedge, a timeout stay small), and at most the
        source's ``max_request_bytes`` (``WAN_REQUEST_BYTES`` unless it says) over a round trip of
        ``LINK_RTT_S`` or more (``long_link=False``: not that limit; the sizer goes past it only
        for sizes whose answers it saw come within a round trip); 1024."""
        most = min(self.budget / 16, self.REQUEST_BYTES)
        rtt = self.link_round_trip()
        wan = long_link and rtt is not None and rtt >= self.LINK_RTT_S
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
            cap = min(cap, max(1.0, self.budget / (self.request_size * self.mean_bytes)))
        return cap

    def target(self) -> float:
        """Where the window may grow to: ``GAIN`` x the bandwidth-delay product, within the cap."""
        cap = self._cap()
        if not self.tuned or self.bandwidth is None or self.min_latency is None:
            return cap
        bdp = self.bandwidth * self.min_latency / (self.request_size * self.mean_bytes)
        gain = self.GAIN if self.filled else self.STARTUP_GAIN
        return max(min(cap, self._floor()), min(cap, gain * bdp))

    def _start_floor(self) -> float:
        """Tuned, while the start-up is on, the window is not lowered below its start (in samples):
        the first round trip's rate samples count the answers of part of the window only (BBR's
        startup does not lower its window either)."""
        return 0.0 if self.filled else self._start_samples / self.request_size

    def _floor(self) -> float:
        """The smallest tuned window: ``LOCAL_WINDOW`` over a short link, else ``MIN_WINDOW``."""
        rtt = self.link_round_trip()
        return float(self.LOCAL_WINDOW if rtt is not None and rtt < self.SHORT_LINK_S else self.MIN_WINDOW)

    def link_round_trip(self) -> float | None:
        """The link's round trip: the source's measure without the server's time (its Server-Timing
        header: a busy server's latency is not a link's), else the lowest first-answer latency."""
        told = self._link_rtt() if self._link_rtt is not None else None
        return told if told is not None else self.min_first

    def _evidenced_rtt(self) -> float | None:
        """The link's round trip as the source measures it where it does (None until it has: a
        first answer on a new connection under load reads long at 0 ms), else ``min_first``."""
        return self._link_rtt() if self._link_rtt is not None else self.min_first

    def _ids_fit(self, rtt: float) -> float:
        """The most ids a request may carry so that ``MIN_START`` of them fit ``GAIN`` x the
        bandwidth-delay product over ``rtt`` (0 before a rate is measured)."""
        return self.GAIN * (self.bandwidth or 0.0) * rtt / (self.MIN_START * self.mean_bytes)

    def link_fits(self) -> int | None:
        """Over a long link (a round trip of ``SHORT_LINK_S`` or more): ``_ids_fit``, whole. None
        over a short link, or before its round trip is known (``_evidenced_rtt``)."""
        rtt = self._evidenced_rtt()
        if rtt is None or rtt < self.SHORT_LINK_S:
            return None
        return int(self._ids_fit(rtt))

    def arrived(self, sizes: Iterable[int]) -> None:
        """Samples of ``sizes`` bytes arrived: the delivery-rate clock (``delivered``), the mean
        size (a moving average, 1/20 a sample), its upper envelope (``high_bytes``: the largest,
        decaying towards the mean, half-way in about 2,800 samples) and ``reserve_bytes``."""
        mean, high, total = self.mean_bytes, self.high_bytes, 0
        for n in sizes:
            total += n
            mean += (n - mean) * 0.05
            if n > high:
                high = float(n)
            else:
                high -= (high - mean) * 0.00025
        self.delivered += total
        self.mean_bytes, self.high_bytes = mean, high
        self.reserve_bytes = min(high, self.RESERVE_CAP * mean)

    def sending(self, now: float) -> None:
        """A request goes out at ``now``: the first starts the delivery-rate clock."""
        if not self._marks:
            self._marks.append((now, self.delivered))

    def rate_sample(self, now: float, sent: float, sent_delivered: int) -> None:
        """A request sent at ``sent`` (when ``delivered`` was ``sent_delivered``) was answered at
        ``now``: sample the delivery rate.

        The bytes answered over at least a round trip (and ``RATE_MIN_S``), not per request as BBR
        does per packet: answers come in bursts (a loop not scheduled for a few ms handles many at
        once), and a burst over one request's latency would read as a rate the link never had. As
        BBR takes the longer of a packet's send and ack intervals, the span is the request's own
        lifetime when that is longer: where requests queue (latency above the round trip), the
        answers of a whole window come in less than their latency, and a round trip's span of
        them reads up to latency / round trip times the rate (twice it at 100 ms through the
        latency proxy on 2 busy cores: bench/results/tune.md, run 6), and the window's target
        follows the window up."""
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
        if sent < then:
            then, delivered = sent, sent_delivered
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
        rtt = self._evidenced_rtt()
        if (self.sizer is None or self.busy is None or self.busy > self.LINK_BOUND or self.request_size <= 1
                or rtt is None or rtt < self.SHORT_LINK_S
                or self.request_size * self.mean_bytes < self.bandwidth * rtt):
            return  # a short link; no evidence from the source yet; a request within a round trip
        fits = self._ids_fit(rtt)
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
        if self.sizer is not None and samples and not self.sizer.done:
            change = self.sizer.answered(size, samples, self.window, None if first is None else latency - first,
                                         filled=self.filled)
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
        if latency > 0:
            queued = self.window * (1.0 - self.min_latency / latency)
        target = self.target()
        floor = self._floor() if self.tuned else float(p.initial_inflight or 2)
        if self.tuned:
            # BBR's rule: grow to the target whatever the latency; Vegas' only past the gain
            low, high = _INF, max(self.QUEUE_HIGH, self.SHARE_HIGH * self.window)
        else:
            low, high = self.QUEUE_LOW, self.QUEUE_HIGH
        if queued > high:
            self.window = max(min(floor, target), self.window - 0.5)
            self._note("queueing",
                       lambda: f"answers queue ({queued:.0f} requests' worth): window down to {self.window:.0f}")
        elif self.window > (least := max(target, self._start_floor())):
            self.window = max(least, self.window - 1.0)
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
        if target <= self._floor() == self.LOCAL_WINDOW:
            return (f"{target:.0f}, the least over a short link (round trip {self.link_round_trip() * 1e3:.1f} ms "
                    f"without the server's time; requests take {self.min_latency * 1e3:.1f} ms: the server at work)")
        return (f"{target:.0f} = {self.GAIN:g} x {self.bandwidth / 1e6:,.1f} MB/s x {self.min_latency * 1e3:.1f} ms "
                f"in requests of {self.request_size} ids x {self.mean_bytes / 1e3:,.0f} kB")

    def _cap_reason(self) -> str:
        p = self.prefetch
        if self.tuned and self.budget / (self.request_size * self.mean_bytes) < p.inflight_cap:
            return f"max_bytes {self.budget / 2**20:,.0f} MiB"
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

    def starved(self, now: float, waited: float) -> bool:
        """The byte budget holds requests back now; ``waited``: the seconds the training loop has
        waited on the loader so far. Once the link has carried a budget's worth (the start-up's
        wait is no evidence), if the loop waited ``STARVED_SHARE`` of the time since the last look
        (at least a round trip ago), grow the budget by half, up to ``Prefetch.ceiling_bytes``.
        Returns whether it grew."""
        ceiling = self.prefetch.ceiling_bytes
        if self.budget >= ceiling or self.delivered < self.budget:
            return False
        mark, waited_then = self._starve_mark
        if mark is None or waited < waited_then:
            self._starve_mark = (now, waited)
            return False
        rtt = self.min_latency if self.min_latency is not None else 0.0
        if now - mark < max(rtt, self.BUDGET_EVERY_S):
            return False
        share = (waited - waited_then) / (now - mark)
        self._starve_mark = (now, waited)
        if share < self.STARVED_SHARE:
            return False
        self.budget = min(ceiling, int(self.budget * 1.5))
        self._log("budget", f"byte budget {self.budget / 2**20:,.0f} MiB: the training loop waited on the loader "
                            f"{min(share, 1.0):.0%} of the last {now - mark:.2f} s while the budget held requests "
                            f"back (it follows the link up to {ceiling / 2**20:,.0f} MiB; Prefetch(max_bytes=) "
                            "fixes it)")
        return True

    def failed(self) -> None:
        self.window = max(float(self.MIN_WINDOW if self.tuned else self.prefetch.initial_inflight or 2), self.window / 2)
        self._note("failed", lambda: f"a request failed: window halved to {self.window:.0f}")

    def _note(self, kind: str, message: Callable[[], str]) -> None:
        """Log a window decision: at most one per ``LOG_EVERY`` seconds of each kind
        (this runs per answer: ``message()`` is formatted only when it is logged)."""
        if time.monotonic() - self._logged.get(kind, -_INF) >= self.LOG_EVERY:
            self._log(kind, message())

    def _log(self, kind: str, message: str) -> None:
        self._logged[kind] = time.monotonic()
        tune_log.info("%s", message)
